"""moe_plugin as a Hugging Face experts backend: the entry "moe_plugin" of transformers' ExpertsInterface.

    from_pretrained(..., experts_implementation="moe_plugin")   or   model.set_experts_implementation("moe_plugin")

HF's own experts module (its parameters, its router's choices and weights, its expert parallelism) stays as it
is; only the experts' computation runs on moe_plugin's kernels: the index dispatch (dispatch.plan_routes,
the scatter_rows / gather_sum kernels) and the grouped GEMMs. Where the experts' gate or activation is one
of the layer's (SwiGLU, clamped SwiGLU, gpt-oss's, GeGLU exact or tanh; relu, gelu, silu, relu2, identity
without a gate), checked once against HF's own function on probe values, the whole expert FFN runs as the
layer's fused forward and backward (fused.FusedMoE; one-pass SwiGLU on CPU). Anything else (another
activation, a post-expert norm) runs HF's own function between two grouped GEMMs. Either way every family
computes what HF's grouped_mm backend computes.

Under HF's expert parallelism the module holds only this rank's experts (num_experts is the local count) and
routes to other ranks' experts come as the index num_experts (a sentinel) with weight 0: they are dropped
here, as HF's grouped_mm skips them (no GEMM work, no output, no gradient).

PEFT's LoRA on the experts' parameters (LoraConfig(target_parameters=[...gate_up_proj, ...down_proj])) is read as
its factors (peft.py): the low-rank terms run on the routed rows beside the frozen weights, no merged weight.

Legend: T tokens, D model dim, H expert hidden dim, E experts on this rank, K top-k, R routed rows (T*K), Q LoRA rank.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from moe_plugin import dispatch
from moe_plugin.activations import Activation
from moe_plugin.activations import forward as activation_forward
from moe_plugin.one_process.fused_experts import FusedMoE
from moe_plugin.grouped_linear import grouped_linear

from . import peft as peft_lora

NAME = "moe_plugin"

# HF's act_fn (by type) -> the layer's activation of the hidden layer; gated experts: (HF's default gate) below
_ACT_NAMES = {activations.SiLUActivation: "silu", nn.SiLU: "silu", nn.ReLU: "relu", activations.GELUActivation: "gelu",
              activations.GELUTanh: "gelu_tanh", activations.ReLUSquaredActivation: "relu2",
              activations.LinearActivation: "identity", nn.Identity: "identity"}
_GATED = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}
_PLAIN = ("relu", "gelu", "silu", "relu2", "identity")
_PROBE_ROWS, _PROBE_HIDDEN = 64, 8
_checked: dict = {}    # (experts class, act_fn class, candidate, concatenated) -> whether it computes HF's function


def activation_of(experts: nn.Module) -> Optional[Activation]:
    """The layer's activation that computes what HF's gate (gated experts) or act_fn does on these experts, or
    None when only HF's own function does (the backend then runs it between the grouped GEMMs). A candidate is
    read off HF's types and attributes, then checked once on probe values against HF's own function."""
    if experts.has_post_expert_norm:
        return None
    candidate = _candidate(experts)
    if candidate is None:
        return None
    key = (type(experts), type(getattr(experts, "act_fn", None)), candidate, experts.is_concatenated)
    if key not in _checked:
        _checked[key] = _same_function(experts, candidate)
    return candidate if _checked[key] else None


def _candidate(experts: nn.Module) -> Optional[Activation]:
    act = _act_name(getattr(experts, "act_fn", None))
    if not experts.has_gate:
        return Activation(act) if act in _PLAIN else None
    if type(experts)._apply_gate is _default_apply_gate:
        return Activation(_GATED[act]) if act in _GATED and experts.is_concatenated else None
    # a family's own gate: clamped SwiGLU (limit) or gpt-oss's (limit and alpha), under the names HF uses
    limit = _first_attribute(experts, ("limit", "swiglu_limit"))
    alpha = _first_attribute(experts, ("alpha", "swiglu_alpha"))
    if limit is None:
        return None
    return Activation("swiglu", float(limit)) if alpha is None else Activation("swiglu_oai", float(limit), float(alpha))


def _act_name(act_fn) -> Optional[str]:
    return "silu" if act_fn is F.silu else _ACT_NAMES.get(type(act_fn))


def _first_attribute(module: nn.Module, names):
    return next((getattr(module, n) for n in names if getattr(module, n, None) is not None), None)


def _same_function(experts: nn.Module, candidate: Activation) -> bool:
    """HF's gate / act_fn and the candidate agree (fp64) on probe values that cross the clamp limits."""
    generator = torch.Generator().manual_seed(0)
    width = 2 * _PROBE_HIDDEN if candidate.gated else _PROBE_HIDDEN
    scale = 2.0 * (candidate.limit or 4.0)
    pre = (torch.rand(_PROBE_ROWS, width, generator=generator, dtype=torch.float64) * 2 - 1) * scale
    with torch.no_grad():
        try:
            theirs = experts._apply_gate(pre) if experts.has_gate else experts.act_fn(pre)
        except (RuntimeError, TypeError):     # a gate with parameters of another dtype or device: HF's own, then
            return False
        ours = activation_forward(pre[:, _concatenated_order(experts, width)], candidate)
    return theirs.shape == ours.shape and torch.allclose(theirs, ours, rtol=1e-9, atol=1e-12)


def _concatenated_order(experts: nn.Module, width: int) -> torch.Tensor:
    """Columns of HF's first projection in the layer's [gate | up] order (gpt-oss interleaves gate, up)."""
    if not experts.has_gate or experts.is_concatenated:
        return torch.arange(width)
    return torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])


def expert_weights(experts: nn.Module):
    """(w1_EDH, b1_EH, w2_EHD, b2_ED, lora) of HF's experts in the layer's orientation: [E, D, 2H or H] and [E, H, D]
    (views of HF's tensors, transposed where HF keeps them [E, out, in]); biases None without has_bias. lora: the
    factors (up_a_EDQ, up_b_EQH, down_a_EHQ, down_b_EQD; B times its scale; a pair None) of PEFT's LoRA on the
    projections (peft.py), whose stored weights are then read instead of PEFT's merged W + s B A."""
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    lora = []
    weights = []
    for name in (up_name, "down_proj"):
        found = peft_lora.factors(experts, name, experts.is_transposed)
        weight, a, b = (getattr(experts, name), None, None) if found is None else found
        weights.append(weight if experts.is_transposed else weight.transpose(1, 2))
        lora += [a, b]
    b1 = b2 = None
    if experts.has_bias:
        b1 = experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias
        b2 = experts.down_proj_bias
    return weights[0], b1, weights[1], b2, tuple(lora)


def moe_plugin_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward contract: hidden_states [T, D], top_k_index [T, K] (this rank's expert ids;
    num_experts marks a route to another rank under HF's EP), top_k_weights [T, K] -> [T, D]."""
    w1_EDH, b1_EH, w2_EHD, b2_ED, lora = expert_weights(self)
    dtype = w1_EDH.dtype                                # as HF's grouped_mm: compute in the weights' dtype
    x_TD, gate_TK = hidden_states.to(dtype), top_k_weights.to(dtype)
    plan, offs_E = _routes(top_k_index, self.num_experts)
    activation = activation_of(self)
    if activation is not None:
        if not self.is_concatenated:     # gpt-oss: HF's [g0, u0, g1, u1, ...] columns as [gate | up]
            order = _concatenated_order(self, w1_EDH.shape[-1]).to(w1_EDH.device)
            w1_EDH = w1_EDH.index_select(-1, order)
            b1_EH = None if b1_EH is None else b1_EH.index_select(-1, order)
            lora = (lora[0], None if lora[1] is None else lora[1].index_select(-1, order)) + lora[2:]
        y_TD = FusedMoE.apply(x_TD, gate_TK, plan.pos_TK, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED, *lora)
    else:
        y_TD = _general(self, x_TD, gate_TK, plan, offs_E, w1_EDH, b1_EH, w2_EHD, b2_ED, lora)
    return y_TD.to(hidden_states.dtype)


def _routes(top_k_index: torch.Tensor, num_experts: int):
    """(plan, offs_E): every choice's routed row, dropless; ids >= num_experts (HF's EP sentinel) get a
    bucket of their own past the last expert's rows and are then dropped (pos -1)."""
    plan = dispatch.plan_routes(top_k_index, num_experts + 1, 0.0, 0)
    pos_TK = plan.pos_TK.masked_fill(top_k_index >= num_experts, -1)
    return dataclasses.replace(plan, pos_TK=pos_TK, kept_TK=pos_TK >= 0), plan.offs_E[:num_experts]


def _general(experts, x_TD, gate_TK, plan, offs_E, w1_EDH, b1_EH, w2_EHD, b2_ED, lora):
    """HF's own gate / activation / post-expert norm between the grouped GEMMs (autograd through each); PEFT's
    low-rank terms as two more grouped GEMMs each, on the same rows."""
    x_RD = dispatch.encode(x_TD, plan)
    h_RH = _with_lora(grouped_linear(x_RD, w1_EDH, offs_E, b1_EH), x_RD, lora[0], lora[1], offs_E)
    h_RH = experts._apply_gate(h_RH) if experts.has_gate else experts.act_fn(h_RH)
    y_RD = _with_lora(grouped_linear(h_RH, w2_EHD, offs_E, b2_ED), h_RH, lora[2], lora[3], offs_E)
    if experts.has_post_expert_norm:
        y_RD = experts.post_expert_norm(y_RD)
    return dispatch.decode(y_RD, gate_TK, plan)


def _with_lora(out_RO, in_RI, a_EIQ, b_EQO, offs_E):
    if a_EIQ is None:
        return out_RO
    return out_RO + grouped_linear(grouped_linear(in_RI, a_EIQ, offs_E), b_EQO, offs_E)


def register() -> None:
    """Adds "moe_plugin" to HF's ExpertsInterface (idempotent), and PEFT's two hooks of peft.py (shape checks,
    target_parameters by the layer's own names refused)."""
    ExpertsInterface.register(NAME, moe_plugin_experts_forward)
    peft_lora.answer_shape_checks_cheaply()
    peft_lora.refuse_layer_names_in_target_parameters()


register()
