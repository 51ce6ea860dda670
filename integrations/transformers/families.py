"""The Hugging Face MoE families: one entry each.

An entry says how to find the family's sparse-MoE blocks (the class in its modeling module), how
its router, experts and shared expert map to MoEConfig (a function of the HF config), and how the
weights map both ways (one WeightMap per MoELayer tensor; see family.py). Tensor names are relative
to the block on the HF side and to the MoELayer on ours. Adding a family is adding one entry to
FAMILIES; entries whose blocks need the layer's less common features (clamped SwiGLU, router bias, input
gating, ...) are in families_special.py.
An entry is keyed by the model_type of the config its blocks are built from; composite models (COMPOSITES)
are found through their nested text configs (families_in). A config value the layer cannot compute raises
a ValueError naming the key and value (family.unsupported).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .family import (Family, WeightMap, _common, activation, family, flat_experts,  # noqa: F401 (WeightMap: re-exported)
                     routed_experts, row, same, shared_mlp, stacked_experts, unsupported)
from .families_special import SPECIAL_COMPOSITES, SPECIAL_FAMILIES, SPECIAL_GROUPS, SPECIAL_NOTES


def _mixtral(c):
    return _common(c, c.intermediate_size, c.num_local_experts, True)


def _qwen3_moe(c):
    return _common(c, c.moe_intermediate_size, c.num_experts, c.norm_topk_prob)


def _qwen3_vl_moe(c):   # Qwen3-VL-MoE and Qwen3.5-MoE always normalize
    return _common(c, c.moe_intermediate_size, c.num_experts, True)


def _olmoe(c):
    return _common(c, c.intermediate_size, c.num_experts, c.norm_topk_prob)


def _flex_olmo(c):
    return _common(c, c.intermediate_size, c.num_local_experts, c.norm_topk_prob)


def _qwen2_moe(c):
    return {**_common(c, c.moe_intermediate_size, c.num_experts, c.norm_topk_prob),
            "shared_hidden_size": c.shared_expert_intermediate_size, "shared_gate": True}


def _qwen3_5_moe(c):
    return {**_qwen3_vl_moe(c), "shared_hidden_size": c.shared_expert_intermediate_size, "shared_gate": True}


def _deepseek_v3(c, shared: bool = True):
    """DeepSeek-V3's router (sigmoid, choice-only bias, groups scored by their two best, scale) and its shared
    experts; GLM-4.5, dots.llm1, Kimi-Linear, MiMo-V2-Flash and DeepSeek-V3.2 copy it."""
    return {**_common(c, c.moe_intermediate_size, c.num_local_experts, c.norm_topk_prob),
            "router": "sigmoid", "num_groups": c.n_group or 1, "topk_groups": c.topk_group or 1,
            "route_scale": float(c.routed_scaling_factor), "expert_bias_update_rate": 0.0,
            "shared_hidden_size": c.moe_intermediate_size * c.n_shared_experts if shared else 0}


def _mimo_v2_flash(c):
    return _deepseek_v3(c, shared=False)


def _mistral4(c):   # DeepSeek-V3's groups over softmax probabilities, no bias
    return {**_deepseek_v3(c), "router": "softmax"}


def _minimax_m2(c):   # sigmoid scores, a choice-only bias, always normalized
    return {**_common(c, c.intermediate_size, c.num_local_experts, True), "router": "sigmoid"}


def _afmoe(c):
    return {**_common(c, c.moe_intermediate_size, c.num_experts, True), "router": "sigmoid",
            "route_scale": float(c.route_scale), "shared_hidden_size": c.moe_intermediate_size * c.num_shared_experts}


def _lfm2_moe(c):   # its experts use SiLU whatever the config says; the normalization adds 1e-6 to the sum
    return {**_common(c, c.moe_intermediate_size, c.num_experts, c.norm_topk_prob, act="swiglu"),
            "router": "sigmoid", "route_scale": float(c.routed_scaling_factor)}


def _per_layer(c, key: str):
    """HunYuan allows a list per layer; the layer takes one value for every block."""
    value = getattr(c, key)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise unsupported(c, key, value, "one value for every layer")
        value = value[0]
    return value


def _hunyuan_v1_moe(c):
    return {**_common(c, c.intermediate_size, _per_layer(c, "num_experts"), True, top_k=_per_layer(c, "moe_topk")),
            "shared_hidden_size": c.intermediate_size}


def _ernie4_5_moe(c):
    base = _common(c, c.moe_intermediate_size, c.num_experts, True)
    if not c.moe_norm_min < base["top_k"] / base["num_experts"]:   # the top-k sum is never below k / E
        raise unsupported(c, "moe_norm_min", c.moe_norm_min, "less than num_experts_per_tok / num_experts "
                          "(the layer divides by the top-k sum unclamped)")
    return {**base, "shared_hidden_size": c.moe_intermediate_size * c.moe_num_shared_experts}


def _aria_text(c):   # HF's Aria experts use SiLU whatever hidden_act is; its shared experts use hidden_act
    return {**_common(c, c.intermediate_size, c.moe_num_experts, True, top_k=c.moe_topk),
            "shared_hidden_size": c.intermediate_size * c.moe_num_shared_experts}


def _jamba(c):
    return _common(c, c.intermediate_size, c.num_experts, False)


def _dbrx(c):
    ffn = c.ffn_config
    p = ffn.moe_normalize_expert_weights
    if p not in (None, 1, 1.0):
        raise unsupported(c, "ffn_config.moe_normalize_expert_weights", p, "None or 1 (the sum)")
    act = ffn.ffn_act_fn.get("name", "silu")
    return _common(c, ffn.ffn_hidden_size, ffn.moe_num_experts, p is not None, top_k=ffn.moe_top_k,
                   model_dim=c.d_model, act=activation(c, "ffn_config.ffn_act_fn", act))


def _cohere2_moe(c):
    if c.expert_selection_fn not in ("softmax", "sigmoid"):
        raise unsupported(c, "expert_selection_fn", c.expert_selection_fn, "'softmax', 'sigmoid'")
    if c.num_shared_experts > 0 and c.shared_expert_combination_strategy != "sum":
        raise unsupported(c, "shared_expert_combination_strategy", c.shared_expert_combination_strategy, "'sum'")
    softmax = c.expert_selection_fn == "softmax"   # softmax over the top-k logits: always normalized
    return {**_common(c, c.intermediate_size, c.num_experts, softmax or c.norm_topk_prob),
            "router": "softmax" if softmax else "sigmoid",
            "shared_hidden_size": c.intermediate_size * c.num_shared_experts}


def _granite(c):
    return _common(c, c.intermediate_size, c.num_local_experts, True)


def _jitter(key: str):
    return lambda c: float(getattr(c, key) or 0.0)


SHARED_GATE = shared_mlp("shared_expert") + (row("shared_expert.gate_D", "shared_expert_gate.weight"),)
DEEPSEEK = routed_experts() + shared_mlp("shared_experts") + (same("router.expert_bias_E", "gate.e_score_correction_bias"),)
GRANITE = routed_experts(router="router.weight")

# The first five are the original families (listed first in messages). Each entry's model_type is that of the
# config its blocks are built from: a composite model (Qwen3-VL-MoE,
# Qwen3-Omni-MoE, GLM-4.5V, Aria) is found through its text configs (families_in).
FAMILIES: Dict[str, Family] = {f.model_type: f for f in (
    family("mixtral", "MixtralSparseMoeBlock", _mixtral, routed_experts(), jitter_noise=_jitter("router_jitter_noise")),
    family("qwen2_moe", "Qwen2MoeSparseMoeBlock", _qwen2_moe, routed_experts() + SHARED_GATE),
    family("qwen3_moe", "Qwen3MoeSparseMoeBlock", _qwen3_moe, routed_experts()),
    family("olmoe", "OlmoeSparseMoeBlock", _olmoe, routed_experts()),
    family("deepseek_v3", "DeepseekV3MoE", _deepseek_v3, DEEPSEEK),
    family("minimax", "MiniMaxSparseMoeBlock", _mixtral, routed_experts(), jitter_noise=_jitter("router_jitter_noise")),
    family("mellum", "MellumSparseMoeBlock", _qwen3_moe, routed_experts()),
    family("qwen3_vl_moe_text", "Qwen3VLMoeTextSparseMoeBlock", _qwen3_vl_moe, routed_experts(), module="qwen3_vl_moe"),
    family("qwen3_omni_moe_text", "Qwen3OmniMoeThinkerTextSparseMoeBlock", _qwen3_moe, routed_experts(),
           module="qwen3_omni_moe"),
    family("qwen3_omni_moe_talker_text", "Qwen3OmniMoeTalkerTextSparseMoeBlock", _qwen2_moe,
           routed_experts() + SHARED_GATE, module="qwen3_omni_moe"),
    family("qwen3_next", "Qwen3NextSparseMoeBlock", _qwen2_moe, routed_experts() + SHARED_GATE),
    family("qwen3_5_moe_text", "Qwen3_5MoeSparseMoeBlock", _qwen3_5_moe, routed_experts() + SHARED_GATE,
           module="qwen3_5_moe"),
    family("flex_olmo", "FlexOlmoSparseMoeBlock", _flex_olmo, routed_experts()),
    family("deepseek_v32", "DeepseekV32MoE", _deepseek_v3, DEEPSEEK),
    family("glm4_moe", "Glm4MoeMoE", _deepseek_v3, DEEPSEEK),
    family("glm4_moe_lite", "Glm4MoeLiteMoE", _deepseek_v3, DEEPSEEK),
    family("glm4v_moe_text", "Glm4vMoeTextMoE", _deepseek_v3, DEEPSEEK, module="glm4v_moe"),
    family("dots1", "Dots1MoE", _deepseek_v3, DEEPSEEK),
    family("kimi_linear", "KimiLinearMoE", _deepseek_v3, DEEPSEEK),
    family("mimo_v2_flash", "MiMoV2FlashMoE", _mimo_v2_flash,
           routed_experts() + (same("router.expert_bias_E", "gate.e_score_correction_bias"),)),
    family("mistral4", "Mistral4MoE", _mistral4, routed_experts() + shared_mlp("shared_experts")),
    family("minimax_m2", "MiniMaxM2SparseMoeBlock", _minimax_m2,
           routed_experts() + (same("router.expert_bias_E", "e_score_correction_bias"),),
           jitter_noise=_jitter("router_jitter_noise")),
    family("afmoe", "AfmoeSparseMoeBlock", _afmoe, routed_experts(router="router.gate.weight")
           + shared_mlp("shared_experts") + (same("router.expert_bias_E", "expert_bias"),)),
    family("lfm2_moe", "Lfm2MoeSparseMoeBlock", _lfm2_moe,
           routed_experts() + (same("router.expert_bias_E", "expert_bias").maybe(),)),
    family("hunyuan_v1_moe", "HunYuanMoEV1Moe", _hunyuan_v1_moe,
           routed_experts(router="gate.wg.weight") + shared_mlp("shared_mlp")),
    family("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", _ernie4_5_moe,
           routed_experts() + tuple(m.maybe() for m in shared_mlp("shared_experts"))
           + (row("router.expert_bias_E", "gate.moe_statics.e_score_correction_bias"),)),
    family("granitemoe", "GraniteMoeMoE", _granite, GRANITE),
    family("granitemoeshared", "GraniteMoeSharedMoE", _granite, GRANITE),
    family("granitemoehybrid", "GraniteMoeHybridMoE", _granite, GRANITE),
    family("aria_text", "AriaTextMoELayer", _aria_text, stacked_experts("router.weight") + shared_mlp("shared_experts"),
           module="aria"),
    family("jamba", "JambaSparseMoeBlock", _jamba, routed_experts(router="router.weight")),
    family("dbrx", "DbrxFFN", _dbrx, flat_experts("router.layer.weight", "experts.mlp"),
           jitter_noise=lambda c: float(c.ffn_config.moe_jitter_eps or 0.0)),
    family("cohere2_moe", "Cohere2MoeSparseMoeBlock", _cohere2_moe,
           routed_experts() + tuple(m.maybe() for m in shared_mlp("shared_experts"))),
) + SPECIAL_FAMILIES}

# Composite models whose text configs carry the families above (what swap_moe_blocks swaps in them).
COMPOSITES: Dict[str, Tuple[str, ...]] = {
    "qwen3_vl_moe": ("qwen3_vl_moe_text",),
    "qwen3_5_moe": ("qwen3_5_moe_text",),
    "qwen3_omni_moe": ("qwen3_omni_moe_text", "qwen3_omni_moe_talker_text"),
    "qwen3_omni_moe_thinker": ("qwen3_omni_moe_text",),
    "glm4v_moe": ("glm4v_moe_text",),
    "aria": ("aria_text",),
    **SPECIAL_COMPOSITES,
}

# The README's grouping of the model types (supported_model_types_markdown) and what it says of some.
GROUPS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("Softmax top-k, Mixtral-style", ("mixtral", "minimax", "qwen3_moe", "mellum", "olmoe", "flex_olmo",
                                      "qwen3_vl_moe_text", "qwen3_omni_moe_text", "jamba", "dbrx",
                                      "granitemoe", "granitemoeshared", "granitemoehybrid")),
    ("Softmax top-k with a shared expert", ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text",
                                            "qwen3_omni_moe_talker_text", "hunyuan_v1_moe", "ernie4_5_moe",
                                            "aria_text", "cohere2_moe", "mistral4")),
    ("DeepSeek-V3-style (sigmoid, choice-only bias, expert groups, scale, shared experts)",
     ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm4v_moe_text", "dots1", "kimi_linear",
      "mimo_v2_flash")),
    ("Sigmoid with a choice-only bias", ("minimax_m2", "afmoe", "lfm2_moe")),
) + SPECIAL_GROUPS
NOTES: Dict[str, str] = {
    "granitemoeshared": "the decoder layer's shared MLP (`shared_mlp`) stays HF's; the routed block is swapped "
                        "(the same for `granitemoehybrid`, whose Mamba and attention layers stay HF's too)",
    "jamba": "only the MoE layers (every `expert_layer_period`-th) are swapped; dense MLP and Mamba layers stay HF's",
    "ernie4_5_moe": "the `moe_statics` bias is the choice-only bias; `moe_norm_min` must stay below top-k / experts",
    "lfm2_moe": "HF adds 1e-6 to the top-k sum it divides by, the layer nothing: gates agree to about 1e-6 relative",
    "hunyuan_v1_moe": "`num_experts` and `moe_topk` given per layer must be the same for every layer",
    "cohere2_moe": "`shared_expert_combination_strategy` \"sum\" only (\"average\" is refused)",
    "dbrx": "`ffn_config.moe_normalize_expert_weights` None or 1 only",
    **SPECIAL_NOTES,
}


def hf_config_of(model_or_config):
    """An HF model's config, or the config itself."""
    return model_or_config if hasattr(model_or_config, "model_type") else getattr(model_or_config, "config", None)


def family_of(model_or_config) -> Optional[Family]:
    """The family entry of an HF model or config (by its model_type), or None (also for a composite model:
    see families_in)."""
    return FAMILIES.get(getattr(hf_config_of(model_or_config), "model_type", None))


def families_in(model_or_config) -> List[Tuple[Family, object]]:
    """(family, the HF config its blocks are built from) for the config of an HF model and every config nested
    in it (a composite model's text configs), outermost first; empty when none is a family."""
    found, todo, seen = [], [hf_config_of(model_or_config)], set()
    while todo:
        config = todo.pop(0)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "model_type", None) in FAMILIES:
            found.append((FAMILIES[config.model_type], config))
            continue
        todo.extend(v for v in vars(config).values() if hasattr(v, "model_type") and hasattr(v, "to_dict"))
    return found


def supported_model_types() -> List[str]:
    """Every model_type swap_moe_blocks takes: the families and the composites holding them."""
    return sorted({*FAMILIES, *COMPOSITES})


def unsupported_model(model_or_config) -> ValueError:
    config = hf_config_of(model_or_config)
    what = (f"model_type={getattr(config, 'model_type', None)!r}" if config is not None
            else f"a {type(model_or_config).__name__} with no .config")
    return ValueError(f"{what} has no Hugging Face MoE family in moe_plugin; supported model_type values: "
                      f"{', '.join(supported_model_types())}")


def require_family(model_or_config) -> Family:
    """The family of a model whose own config is a family's (for a composite model see families_in)."""
    family = family_of(model_or_config)
    if family is None:
        raise unsupported_model(model_or_config)
    return family


def require_families(model_or_config) -> List[Tuple[Family, object]]:
    found = families_in(model_or_config)
    if not found:
        raise unsupported_model(model_or_config)
    return found


def hf_to_layer(family: Family, hf_state: Mapping[str, torch.Tensor], num_experts: Optional[int] = None
                ) -> Dict[str, torch.Tensor]:
    """An HF block's tensors (names relative to the block) -> the MoELayer's full state (all experts).
    Optional tensors the block lacks (a shared expert or bias its config turns off) are left out."""
    out = {}
    for m in family.weights:
        if m.optional and not all(name in hf_state for name in m.hf):
            continue
        tensors = [hf_state[name] for name in m.hf]
        out[m.layer] = m.to_layer(*tensors, num_experts=num_experts) if m.by_expert else m.to_layer(*tensors)
    return out


def layer_to_hf(family: Family, layer_state: Mapping[str, torch.Tensor], partial: bool = False
                ) -> Dict[str, torch.Tensor]:
    """The MoELayer's full state (or gradients, by the same names) -> the HF block's tensors. Optional tensors
    absent from layer_state are left out; with partial, any absent tensor is (gradients of a few)."""
    out = {}
    for m in family.weights:
        if m.layer not in layer_state and (partial or m.optional):
            continue
        out.update(zip(m.hf, m.to_hf(layer_state[m.layer])))
    return out


def supported_model_types_markdown() -> str:
    """The README's list of supported model types (between its families markers; a test keeps them equal)."""
    lines = []
    for title, members in GROUPS:
        lines.append(f"- **{title}:** " + ", ".join(f"`{t}`" for t in members if t in FAMILIES or t in COMPOSITES))
    grouped = {t for _, members in GROUPS for t in members}
    rest = [t for t in sorted(FAMILIES) if t not in grouped]
    if rest:
        lines.append("- **Other:** " + ", ".join(f"`{t}`" for t in rest))
    composites = "; ".join(f"`{c}` (its {', '.join(f'`{t}`' for t in ts)} blocks)" for c, ts in COMPOSITES.items())
    lines.append(f"- **Composite models** (swapped through their text configs): {composites}")
    lines += [f"- `{t}`: {note}" for t, note in NOTES.items() if t in FAMILIES]
    return "\n".join(lines) + "\n"
