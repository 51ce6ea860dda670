"""The Hugging Face MoE families: one entry each.

An entry says how to find the family's sparse-MoE blocks (the class in its modeling module), how
its router, experts and shared expert map to MoEConfig (a function of the HF config), and how the
weights map both ways (one WeightMap per MoELayer tensor). Tensor names are relative to the block
on the HF side and to the MoELayer on ours. Adding a family is adding one entry to FAMILIES.

Legend: E experts, D model dim, H expert hidden dim, S shared expert hidden dim.
HF keeps routed experts as gate_up_proj [E, 2H, D] (rows [gate | up]) and down_proj [E, D, H];
the layer keeps w1_EDH [E, D, 2H] (columns [gate | up]) and w2_EHD [E, H, D]. The shared expert is
an HF MLP of three Linears (gate_proj, up_proj [S, D], down_proj [D, S]); ours is w1_DH [D, 2S]
(columns [gate | up]) and w2_HD [S, D]; Qwen2-MoE's shared gate Linear(D, 1) is our gate_D [D].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

ACTIVATIONS = {"silu": "swiglu"}   # HF hidden_act of a gated MLP -> our activation


@dataclass(frozen=True)
class WeightMap:
    """One tensor of the layer and the HF tensor(s) it is made of; to_layer and to_hf invert each other."""
    layer: str
    hf: Tuple[str, ...]
    to_layer: Callable[..., torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tuple[torch.Tensor, ...]]


def same(layer: str, hf: str) -> WeightMap:
    return WeightMap(layer, (hf,), lambda t: t, lambda t: (t,))


def transposed(layer: str, hf: str) -> WeightMap:
    """The last two dimensions swapped: HF's [out, in] (per expert) against our [in, out]."""
    return WeightMap(layer, (hf,), lambda t: t.transpose(-1, -2), lambda t: (t.transpose(-1, -2),))


def gate_and_up(layer: str, gate: str, up: str) -> WeightMap:
    """Two HF Linear weights [S, D] against one [D, 2S] = [gate | up] columns."""
    return WeightMap(layer, (gate, up), lambda g, u: torch.cat([g.t(), u.t()], dim=1),
                     lambda t: tuple(half.t() for half in t.chunk(2, dim=1)))


def routed_experts(router: str = "gate.weight", experts: str = "experts") -> Tuple[WeightMap, ...]:
    return (same("router.weight_ED", router),
            transposed("experts.w1_EDH", f"{experts}.gate_up_proj"),
            transposed("experts.w2_EHD", f"{experts}.down_proj"))


def shared_mlp(hf: str) -> Tuple[WeightMap, ...]:
    return (gate_and_up("shared_expert.w1_DH", f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
            transposed("shared_expert.w2_HD", f"{hf}.down_proj.weight"))


def row(layer: str, hf: str) -> WeightMap:
    """HF's Linear(D, 1) weight [1, D] against our vector [D]."""
    return WeightMap(layer, (hf,), lambda t: t.reshape(-1), lambda t: (t.reshape(1, -1),))


@dataclass(frozen=True)
class Family:
    model_type: str
    module: str                                   # the modeling module holding the block class
    block: str                                    # the sparse-MoE block class in it
    moe_config: Callable[[Any], Dict[str, Any]]   # HF config -> MoEConfig fields
    weights: Tuple[WeightMap, ...]
    jitter_noise: Callable[[Any], float] = lambda config: 0.0   # Mixtral's input jitter in training

    def block_class(self) -> type:
        import importlib
        return getattr(importlib.import_module(self.module), self.block)


def activation(config) -> str:
    act = config.hidden_act
    if act not in ACTIVATIONS:
        raise ValueError(f"{config.model_type}: hidden_act={act!r} is not supported by the MoE layer; "
                         f"supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def _common(config, hidden_size: int, num_experts: int, normalize: bool) -> Dict[str, Any]:
    """What every family shares: dropless, no expert biases, no balance loss of the layer's own
    (the HF model computes its aux loss from the recorded router logits)."""
    return dict(model_dim=config.hidden_size, hidden_size=hidden_size, num_experts=num_experts,
                top_k=config.num_experts_per_tok, router="softmax",
                normalize_gate="before_drop" if normalize else "none",
                activation=activation(config), bias=False, capacity_factor=0.0, aux_loss="none",
                aux_loss_coef=0.0)


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
)}


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
