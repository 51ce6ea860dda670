"""moe_plugin as a Hugging Face experts backend: the entry "moe_plugin" of transformers' ExpertsInterface.

    from_pretrained(..., experts_implementation="moe_plugin")   or   model.set_experts_implementation("moe_plugin")

HF's own experts module (its parameters, its router's choices and weights, its expert parallelism) stays as it
is; only the experts' computation runs on moe_plugin's kernels: the index dispatch (dispatch.plan_routes,
the scatter_rows / gather_sum kernels) and the grouped GEMMs. Where the experts' activation is one the layer
computes (SwiGLU, or a plain relu / gelu / silu / identity without a gate), the whole expert FFN runs as the
layer's fused forward and backward (fused.FusedMoE, one-pass SwiGLU on CPU). Any other gate or activation
(clamped SwiGLU, GeGLU, gpt-oss's, a post-expert norm) runs HF's own function between two grouped GEMMs, so
every family computes what HF's grouped_mm backend computes.

Under HF's expert parallelism the module holds only this rank's experts (num_experts is the local count) and
routes to other ranks' experts come as the index num_experts (a sentinel) with weight 0: they are dropped
here, as HF's grouped_mm skips them (no GEMM work, no output, no gradient).

Legend: T tokens, D model dim, H expert hidden dim, E experts on this rank, K top-k, R routed rows (T*K).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from moe_plugin import dispatch
from moe_plugin.fused import FusedMoE
from moe_plugin.grouped_linear import grouped_linear

NAME = "moe_plugin"

# HF's act_fn (by type, or the function itself) -> the layer's activation name
_ACT_NAMES = {activations.SiLUActivation: "silu", nn.SiLU: "silu", nn.ReLU: "relu",
              activations.LinearActivation: "identity", nn.Identity: "identity"}
_GATED = {"silu": "swiglu"}                       # gated experts (default [gate | up] gate) the layer fuses
_PLAIN = ("relu", "gelu", "silu", "identity")     # non-gated experts the layer fuses


def activation_of(experts: nn.Module):
    """The layer's activation that computes exactly what HF's gate (or act_fn) does on these experts, or None
    when only HF's own function does (then the backend runs it between the grouped GEMMs)."""
    if experts.has_post_expert_norm:
        return None
    act = _act_name(getattr(experts, "act_fn", None))
    if experts.has_gate:
        if type(experts)._apply_gate is not _default_apply_gate or not experts.is_concatenated:
            return None
        return _GATED.get(act)
    return act if act in _PLAIN else None


def _act_name(act_fn):
    if act_fn is F.silu:
        return "silu"
    if type(act_fn) is activations.GELUActivation and act_fn.act is F.gelu:
        return "gelu"
    return _ACT_NAMES.get(type(act_fn))


def expert_weights(experts: nn.Module):
    """(w1_EDH, b1_EH, w2_EHD, b2_ED) of HF's experts in the layer's orientation: [E, D, 2H or H] and [E, H, D]
    (views of HF's tensors, transposed where HF keeps them [E, out, in]); biases None without has_bias."""
    w1 = experts.gate_up_proj if experts.has_gate else experts.up_proj
    b1 = b2 = None
    if experts.has_bias:
        b1 = experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias
        b2 = experts.down_proj_bias
    w2 = experts.down_proj
    if not experts.is_transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    return w1, b1, w2, b2


def moe_plugin_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward contract: hidden_states [T, D], top_k_index [T, K] (this rank's expert ids;
    num_experts marks a route to another rank under HF's EP), top_k_weights [T, K] -> [T, D]."""
    w1_EDH, b1_EH, w2_EHD, b2_ED = expert_weights(self)
    dtype = w1_EDH.dtype                                # as HF's grouped_mm: compute in the weights' dtype
    x_TD, gate_TK = hidden_states.to(dtype), top_k_weights.to(dtype)
    plan, offs_E = _routes(top_k_index, self.num_experts)
    activation = activation_of(self)
    if activation is not None:
        y_TD = FusedMoE.apply(x_TD, gate_TK, plan.pos_TK, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED)
    else:
        y_TD = _general(self, x_TD, gate_TK, plan, offs_E, w1_EDH, b1_EH, w2_EHD, b2_ED)
    return y_TD.to(hidden_states.dtype)


def _routes(top_k_index: torch.Tensor, num_experts: int):
    """(plan, offs_E): every choice's routed row, dropless; ids >= num_experts (HF's EP sentinel) get a
    bucket of their own past the last expert's rows and are then dropped (pos -1)."""
    plan = dispatch.plan_routes(top_k_index, num_experts + 1, 0.0, 0)
    pos_TK = plan.pos_TK.masked_fill(top_k_index >= num_experts, -1)
    return dataclasses.replace(plan, pos_TK=pos_TK, kept_TK=pos_TK >= 0), plan.offs_E[:num_experts]


def _general(experts, x_TD, gate_TK, plan, offs_E, w1_EDH, b1_EH, w2_EHD, b2_ED):
    """HF's own gate / activation / post-expert norm between the grouped GEMMs (autograd through each)."""
    h_RH = grouped_linear(dispatch.encode(x_TD, plan), w1_EDH, offs_E, b1_EH)
    h_RH = experts._apply_gate(h_RH) if experts.has_gate else experts.act_fn(h_RH)
    y_RD = grouped_linear(h_RH, w2_EHD, offs_E, b2_ED)
    if experts.has_post_expert_norm:
        y_RD = experts.post_expert_norm(y_RD)
    return dispatch.decode(y_RD, gate_TK, plan)


def register() -> None:
    """Adds "moe_plugin" to HF's ExpertsInterface (idempotent)."""
    ExpertsInterface.register(NAME, moe_plugin_experts_forward)


register()
