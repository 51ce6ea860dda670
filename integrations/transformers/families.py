"""The Hugging Face MoE families: one entry each.

An entry says how to find the family's sparse-MoE blocks (the class in its modeling module), how
its router, experts and shared expert map to MoEConfig (a function of the HF config), and how the
weights map both ways (one WeightMap per MoELayer tensor; see family.py). Tensor names are relative
to the block on the HF side and to the MoELayer on ours. Adding a family is adding one entry to
FAMILIES; entries that need the layer's newer expert and router features are in families_featured.py.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from .family import (Family, WeightMap, _common, routed_experts,  # noqa: F401 (WeightMap: re-exported)
                     row, same, shared_mlp)
from .families_featured import FEATURED_FAMILIES


def _mixtral(c):
    return _common(c, c.intermediate_size, c.num_local_experts, True)


def _qwen3_moe(c):
    return _common(c, c.moe_intermediate_size, c.num_experts, c.norm_topk_prob)


def _olmoe(c):
    return _common(c, c.intermediate_size, c.num_experts, c.norm_topk_prob)


def _qwen2_moe(c):
    return {**_common(c, c.moe_intermediate_size, c.num_experts, c.norm_topk_prob),
            "shared_hidden_size": c.shared_expert_intermediate_size, "shared_gate": True}


def _deepseek_v3(c):
    return {**_common(c, c.moe_intermediate_size, c.n_routed_experts, c.norm_topk_prob),
            "router": "sigmoid", "num_groups": c.n_group or 1, "topk_groups": c.topk_group or 1,
            "route_scale": float(c.routed_scaling_factor), "expert_bias_update_rate": 0.0,
            "shared_hidden_size": c.moe_intermediate_size * c.n_shared_experts}


FAMILIES: Dict[str, Family] = {f.model_type: f for f in (
    Family("mixtral", "transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock", _mixtral,
           routed_experts(), jitter_noise=lambda c: float(c.router_jitter_noise)),
    Family("qwen2_moe", "transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", _qwen2_moe,
           routed_experts() + shared_mlp("shared_expert") + (row("shared_expert.gate_D", "shared_expert_gate.weight"),)),
    Family("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", _qwen3_moe,
           routed_experts()),
    Family("olmoe", "transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", _olmoe,
           routed_experts()),
    Family("deepseek_v3", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", _deepseek_v3,
           routed_experts() + shared_mlp("shared_experts")
           + (same("router.expert_bias_E", "gate.e_score_correction_bias"),)),
) + FEATURED_FAMILIES}


def hf_config_of(model_or_config):
    """An HF model's config, or the config itself."""
    return model_or_config if hasattr(model_or_config, "model_type") else getattr(model_or_config, "config", None)


def family_of(model_or_config) -> Optional[Family]:
    """The family entry of an HF model or config (by its model_type), or None."""
    return FAMILIES.get(getattr(hf_config_of(model_or_config), "model_type", None))


def require_family(model_or_config) -> Family:
    family = family_of(model_or_config)
    if family is None:
        config = hf_config_of(model_or_config)
        what = (f"model_type={getattr(config, 'model_type', None)!r}" if config is not None
                else f"a {type(model_or_config).__name__} with no .config")
        raise ValueError(f"{what} has no Hugging Face MoE family in moe_plugin; supported model_type values: "
                         f"{', '.join(sorted(FAMILIES))}")
    return family


def hf_to_layer(family: Family, hf_state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """An HF block's tensors (names relative to the block) -> the MoELayer's full state (all experts)."""
    return {m.layer: m.to_layer(*(hf_state[name] for name in m.hf)) for m in family.weights}


def layer_to_hf(family: Family, layer_state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The MoELayer's full state (or gradients, by the same names) -> the HF block's tensors."""
    out = {}
    for m in family.weights:
        out.update(zip(m.hf, m.to_hf(layer_state[m.layer])))
    return out
