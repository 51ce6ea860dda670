"""Hugging Face MoE families whose blocks need the layer's less common expert and router features
(GeGLU, clamped SwiGLU, router bias, gating on the expert input, ...). Entries as in families.py.

  gpt_oss         swiglu_oai (limit, alpha), router bias, expert biases; gate/up interleaved in [E, D, 2H]
  llama4_text     sigmoid top-1 gating the expert input; a plain shared MLP; only the MoE layers (moe_layers)
                  (both blocks return (output, router scores), which their decoders unpack: returns_tuple)
  deepseek_v2     softmax, unnormalized, scaled; topk_method "greedy" or "group_limited_greedy" (group_score max)
  glm5_next_text  DeepSeek-V3 routing, SwiGLU clamped at swiglu_limit in the experts and the shared expert
  hy_v4           the same, its shared expert unclamped (clamp_shared False)
  nemotron_h      DeepSeek-V3 routing, non-gated relu2 experts and shared MLP (up_proj, down_proj)
  deepseek_v4     sqrt(softplus) scores, a choice-only bias, normalized, scaled; SwiGLU clamped at swiglu_limit in
                  the experts and the shared expert; only the "moe" layers (the "hash_moe" ones stay HF's: swaps)
  gemma4_text     GeGLU (tanh) experts; the router sees the residual stream through an RMS norm and a learned scale,
                  each chosen gate times a per-expert scale; no block: the decoder layer holds router and experts
                  (in_decoder) and feeds the experts pre_feedforward_layernorm_2 of the router's input
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from .family import Family, WeightMap, _common, activation, family, routed_experts, same, shared_mlp, transposed

# HF mlp_hidden_act of a non-gated MLP (Nemotron-H) -> our activation
PLAIN_ACTIVATIONS = {"relu2": "relu2", "relu": "relu", "gelu": "gelu", "silu": "silu"}


def _unsupported(config, key: str, value, allowed: str) -> ValueError:
    return ValueError(f"{config.model_type}: {key}={value!r} is not supported by the MoE layer; supported: {allowed}")


def _silu_experts(config) -> None:
    """Blocks whose experts apply SiLU whatever hidden_act says, while their shared MLP applies hidden_act."""
    if config.hidden_act != "silu":
        raise _unsupported(config, "hidden_act", config.hidden_act, "'silu' (the experts apply SiLU whatever "
                           "hidden_act says, the shared expert hidden_act: one activation cannot do both)")


def interleaved_gate_up(layer: str, hf: str) -> WeightMap:
    """gpt-oss: [..., 2H] with gate and up alternating (gate = [..., ::2], up = [..., 1::2]) against [gate | up]."""
    def to_hf(t: torch.Tensor) -> Tuple[torch.Tensor]:
        gate, up = t.chunk(2, dim=-1)
        return (torch.stack([gate, up], dim=-1).flatten(-2),)
    return WeightMap(layer, (hf,), lambda t: torch.cat([t[..., ::2], t[..., 1::2]], dim=-1), to_hf)


def _gpt_oss(c):
    return {**_common(c, c.intermediate_size, c.num_local_experts, True, act="swiglu_oai"),   # hidden_act: unused
            "activation_limit": float(c.swiglu_limit), "activation_alpha": float(c.swiglu_alpha),
            "bias": True, "router_bias": True, "fp32_router": False}


def _llama4_text(c):
    if c.num_experts_per_tok != 1:
        raise _unsupported(c, "num_experts_per_tok", c.num_experts_per_tok, "1 (the layer gates the expert input "
                           "for top-1 only, as every released Llama 4)")
    return {**_common(c, c.intermediate_size, c.num_local_experts, False), "router": "sigmoid",
            "gate_on_input": True, "shared_hidden_size": c.intermediate_size, "fp32_router": False}


def _deepseek_v2(c):
    base = {**_common(c, c.moe_intermediate_size, c.n_routed_experts, False),
            "route_scale": float(c.routed_scaling_factor),
            "shared_hidden_size": c.moe_intermediate_size * c.n_shared_experts}
    if c.topk_method not in ("greedy", "group_limited_greedy"):
        raise _unsupported(c, "topk_method", c.topk_method, "'greedy', 'group_limited_greedy'")
    if c.topk_method == "group_limited_greedy" and (c.topk_group or 1) < (c.n_group or 1):
        base.update(num_groups=c.n_group, topk_groups=c.topk_group, group_score="max")
    return base


def _sigmoid_groups(c, act=None):
    """DeepSeek-V3's router: sigmoid scores, a choice-only bias, groups scored by their two best, scale."""
    return {**_common(c, c.moe_intermediate_size, c.num_local_experts, c.norm_topk_prob, act=act), "router": "sigmoid",
            "num_groups": c.n_group or 1, "topk_groups": c.topk_group or 1,
            "route_scale": float(c.routed_scaling_factor), "expert_bias_update_rate": 0.0}


def _glm5_next_text(c):
    _silu_experts(c)
    return {**_sigmoid_groups(c), "activation_limit": float(c.swiglu_limit),
            "shared_hidden_size": c.moe_intermediate_size * c.n_shared_experts}


def _hy_v4(c):
    return {**_glm5_next_text(c), "clamp_shared": False}


def _nemotron_h(c):
    if c.moe_latent_size is not None:
        raise _unsupported(c, "moe_latent_size", c.moe_latent_size, "None (no latent projection around the experts)")
    if c.mlp_bias:
        raise _unsupported(c, "mlp_bias", c.mlp_bias, "False (HF's experts have no biases, its shared MLP would)")
    if c.mlp_hidden_act not in PLAIN_ACTIVATIONS:
        raise _unsupported(c, "mlp_hidden_act", c.mlp_hidden_act, ", ".join(repr(a) for a in PLAIN_ACTIVATIONS))
    return {**_sigmoid_groups(c, PLAIN_ACTIVATIONS[c.mlp_hidden_act]),
            "shared_hidden_size": c.moe_shared_expert_intermediate_size}


def _deepseek_v4(c):
    if c.scoring_func != "sqrtsoftplus":
        raise _unsupported(c, "scoring_func", c.scoring_func, "'sqrtsoftplus'")
    if c.mlp_bias:
        raise _unsupported(c, "mlp_bias", c.mlp_bias, "False (HF's experts have no biases, its shared MLP would)")
    if c.n_shared_experts != 1:   # HF builds one shared MLP of intermediate_size whatever this says
        raise _unsupported(c, "n_shared_experts", c.n_shared_experts, "1 (HF's block holds one shared MLP)")
    if not c.norm_topk_prob:      # HF normalizes the chosen scores whatever this says
        raise _unsupported(c, "norm_topk_prob", c.norm_topk_prob, "True (HF's router always normalizes)")
    if c.hidden_act != "silu":    # activation_limit clamps SwiGLU only
        raise _unsupported(c, "hidden_act", c.hidden_act, "'silu' (HF clamps the gated activation at swiglu_limit)")
    return {**_common(c, c.moe_intermediate_size, c.n_routed_experts, True), "router": "sqrt_softplus",
            "route_scale": float(c.routed_scaling_factor), "expert_bias_update_rate": 0.0,
            "activation_limit": float(c.swiglu_limit), "shared_hidden_size": c.moe_intermediate_size,
            "fp32_router": False}


def _gemma4_text(c):
    return {**_common(c, c.moe_intermediate_size, c.num_experts, True, top_k=c.top_k_experts,
                      act=activation(c, "hidden_activation")),
            "router_norm": True, "router_norm_eps": float(c.rms_norm_eps), "expert_gate_scale": True,
            "fp32_router": False}


def _gemma4_unswapped(decoder) -> bool:
    """The decoder has an MoE block and its experts are still HF's (from the decoder's own modeling file)."""
    return decoder.enable_moe_block and type(decoder.experts).__module__ == type(decoder).__module__


CORRECTION_BIAS = (same("router.expert_bias_E", "gate.e_score_correction_bias"),)

SPECIAL_FAMILIES: Tuple[Family, ...] = (
    family("gpt_oss", "GptOssMLP", _gpt_oss,
           (same("router.weight_ED", "router.weight"), interleaved_gate_up("experts.w1_EDH", "experts.gate_up_proj"),
            interleaved_gate_up("experts.b1_EH", "experts.gate_up_proj_bias"),
            same("experts.w2_EHD", "experts.down_proj"), same("experts.b2_ED", "experts.down_proj_bias"),
            same("router.bias_E", "router.bias")), returns_tuple=True),
    family("llama4_text", "Llama4TextMoe", _llama4_text,
           (same("router.weight_ED", "router.weight"), same("experts.w1_EDH", "experts.gate_up_proj"),
            same("experts.w2_EHD", "experts.down_proj")) + shared_mlp("shared_expert"), returns_tuple=True, module="llama4"),
    family("deepseek_v2", "DeepseekV2Moe", _deepseek_v2,
           routed_experts() + shared_mlp("shared_experts")),
    family("glm5_next_text", "Glm5NextTextMoE", _glm5_next_text,
           routed_experts() + shared_mlp("shared_experts") + CORRECTION_BIAS, module="glm5_next"),
    family("hy_v4", "HYV4MoE", _hy_v4, routed_experts() + shared_mlp("shared_experts") + CORRECTION_BIAS),
    family("nemotron_h", "NemotronHMoE", _nemotron_h,
           (same("router.weight_ED", "gate.weight"), transposed("experts.w1_EDH", "experts.up_proj"),
            transposed("experts.w2_EHD", "experts.down_proj"),
            transposed("shared_expert.w1_DH", "shared_experts.up_proj.weight"),
            transposed("shared_expert.w2_HD", "shared_experts.down_proj.weight")) + CORRECTION_BIAS),
    family("deepseek_v4", "DeepseekV4SparseMoeBlock", _deepseek_v4,
           routed_experts() + shared_mlp("shared_experts") + CORRECTION_BIAS, swaps=lambda block: not block.is_hash),
    family("gemma4_text", "Gemma4TextDecoderLayer", _gemma4_text,
           routed_experts(router="router.proj.weight") + (same("router.input_scale_D", "router.scale"),
                                                           same("router.gate_scale_E", "router.per_expert_scale")),
           swaps=_gemma4_unswapped, in_decoder=True, module="gemma4"),
)

# Composite models whose text configs carry the families above, for families.COMPOSITES.
SPECIAL_COMPOSITES: Dict[str, Tuple[str, ...]] = {"llama4": ("llama4_text",), "glm5_next": ("glm5_next_text",),
                                                 "gemma4": ("gemma4_text",)}

# For the README's table (families.GROUPS / NOTES).
SPECIAL_GROUPS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("Needing the newer layer features (clamped SwiGLU, router bias, input gating, group max, relu2, "
     "sqrt(softplus) scores, router norm)",
     ("gpt_oss", "llama4_text", "deepseek_v2", "glm5_next_text", "hy_v4", "nemotron_h", "deepseek_v4",
      "gemma4_text")),
)
SPECIAL_NOTES: Dict[str, str] = {
    "gpt_oss": "`swiglu_oai` with `swiglu_limit` and `swiglu_alpha`, router and expert biases; the router runs in "
               "the model's dtype as HF's",
    "llama4_text": "only the MoE layers (`moe_layers`) are swapped, dense MLP layers stay HF's; top-1 only "
                   "(`num_experts_per_tok` 1)",
    "deepseek_v2": "`topk_method` \"greedy\" and \"group_limited_greedy\" (a group scored by its best expert)",
    "glm5_next_text": "`hidden_act` \"silu\" only (HF's experts apply SiLU whatever it says)",
    "hy_v4": "its shared expert is not clamped (`clamp_shared` False); `hidden_act` \"silu\" only",
    "nemotron_h": "only the MoE layers are swapped (Mamba and attention stay HF's); `moe_latent_size` None, "
                  "`mlp_bias` False",
    "deepseek_v4": "`sqrtsoftplus` scores and SwiGLU clamped at `swiglu_limit`; only the `moe` layers are swapped: "
                   "the hash-routed first layers (`mlp_layer_types` \"hash_moe\", experts chosen by a token-id "
                   "table) stay HF's",
    "gemma4_text": "no MoE block: in each decoder layer with `enable_moe_block` the `experts` module becomes the "
                   "swapped block and `router` a stand-in handing it the router input (the layer routes it); the "
                   "dense MLP and the norms around both stay HF's; router logits as HF records them (softmax "
                   "probabilities)",
}
