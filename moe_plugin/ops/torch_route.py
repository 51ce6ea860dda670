"""The fused routing (moe_plugin/one_process/fused_route.py) for CPU tensors: the same results as the four Triton kernels of
triton_route.py, as one autograd node (the router, plan_routes and finalize_gates take ~25), for the host time
of small steps: forward, the logits' GEMM and torch's own softmax and topk (so the choices are the reference's bit
for bit), then one native call (csrc/routing_cpu.cpp route_plan: gates, loads, slots, balance loss) where the native
kernels load, else about fifteen torch ops (below; slots from ops.route_slots); backward, one native call
(route_backward) where the native kernels load, else torch ops.

Shape legend: moe_plugin/__init__.py (here T tokens, E experts, K top-k).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import route_slots
from .choice import kernels_for

TINY = torch.finfo(torch.float32).tiny
NORMALIZE = {"none": 0, "before_drop": 1, "after_drop": 2}
AUX_KINDS = {"none": 0, "gshard": 1, "switch": 2}
NOT_GIVEN = object()
EPS = torch.finfo(torch.float32).eps


def route(x_TD: torch.Tensor, w_ED: torch.Tensor, K: int, normalize: str, scale: float, cap: int, aux_kind: str,
          aux_scale: float, z_scale: float, gate_dtype: torch.dtype, native=NOT_GIVEN):
    """(final_TK, aux, pos_TK, kept_TK, load_E, kept_E, offs_E int32) and what backward needs
    (expert_TK, gate_TK: the gates before dropping, probs_TE, lse_T or None, aux_grad_E or None for no balance
    loss). native: the native kernel module (or None: the torch ops), if the caller has looked it up."""
    if torch.is_autocast_enabled(x_TD.device.type):      # the router runs in fp32, as the reference's
        with torch.autocast(x_TD.device.type, enabled=False):
            return route(x_TD, w_ED, K, normalize, scale, cap, aux_kind, aux_scale, z_scale, gate_dtype, native)
    T, E = x_TD.shape[0], w_ED.shape[0]
    if x_TD.dtype != torch.float32:
        x_TD, w_ED = x_TD.to(torch.float32), w_ED.to(torch.float32)
    logits_TE = torch.mm(x_TD, w_ED.t())
    # torch's own softmax and topk, as the reference router and HF's blocks (a softmax of our own rounds differently,
    # which flips near-tied choices: a swapped Qwen3-Omni talker's logits moved by 6e-4); the rest in one native call
    probs_TE = torch.softmax(logits_TE, -1)
    gate_TK, expert_TK = probs_TE.topk(K, -1)
    native = _native(probs_TE.device) if native is NOT_GIVEN else native
    if native is not None:
        final_TK, aux, pos_TK, kept_TK, load_E, kept_E, offs_E, gate_TK, aux_grad_E = native.route_plan(
            probs_TE, gate_TK, expert_TK, NORMALIZE[normalize], cap, AUX_KINDS[aux_kind], aux_scale, scale)
        lse_T = None
        if z_scale:
            lse_T = torch.logsumexp(logits_TE, -1)
            aux = aux + z_scale * lse_T.square().sum()
        outputs = (final_TK.to(gate_dtype), aux, pos_TK, kept_TK, load_E, kept_E, offs_E)
        return outputs, (expert_TK, gate_TK, probs_TE, lse_T, aux_grad_E)
    if normalize == "before_drop":
        gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True).clamp_(min=TINY)
    load_E = torch.bincount(expert_TK.view(-1), minlength=E)
    dropless = cap >= T * K
    kept_E = load_E if dropless else load_E.clamp(max=cap)
    offs_E = kept_E.cumsum(0)
    pos_TK = route_slots(expert_TK, None, offs_E - kept_E, cap, T * K)[0]
    kept_TK = pos_TK >= 0

    if aux_kind == "none":      # a constant 0 (its gradient reaches nothing): no balance-loss ops
        aux_grad_E, aux = None, probs_TE.new_zeros(())
    else:
        counts_E = load_E if aux_kind == "switch" else torch.bincount(expert_TK[:, 0], minlength=E)
        aux_grad_E = counts_E.to(torch.float32).mul_(aux_scale)
        aux = torch.dot(probs_TE.sum(0), aux_grad_E)
    lse_T = None
    if z_scale:
        lse_T = torch.logsumexp(logits_TE, -1)
        aux = aux + z_scale * lse_T.square().sum()

    final_TK = gate_TK if dropless else gate_TK * kept_TK
    if normalize == "after_drop":
        final_TK = final_TK / final_TK.sum(-1, keepdim=True).clamp(min=EPS)
    if scale != 1.0:
        final_TK = final_TK * scale
    outputs = (final_TK.to(gate_dtype), aux, pos_TK, kept_TK, load_E, kept_E, offs_E.to(torch.int32))
    return outputs, (expert_TK, gate_TK, probs_TE, lse_T, aux_grad_E)


def route_backward(grad_final_TK: Optional[torch.Tensor], grad_aux: Optional[torch.Tensor], expert_TK, gate_TK,
                   pos_TK, probs_TE, lse_T, aux_grad_E, normalize: str, scale: float, z_scale: float,
                   out_dtype: torch.dtype, native=NOT_GIVEN) -> torch.Tensor:
    """grad_logits_TE (fp32; out_dtype is the Triton kernels' and unused here): see triton_route.route_backward."""
    if aux_grad_E is None:      # no balance loss (aux "none"): its factors are 0
        aux_grad_E = probs_TE.new_zeros(probs_TE.shape[1])
    native = _native(probs_TE.device) if native is NOT_GIVEN else native
    if native is not None:
        return native.route_backward(grad_final_TK, grad_aux, expert_TK, gate_TK, pos_TK, probs_TE,
                                     probs_TE.new_empty(0) if lse_T is None else lse_T, aux_grad_E,
                                     NORMALIZE[normalize], scale, z_scale)
    grad_TE = None
    if grad_final_TK is not None:
        up_TK = grad_final_TK.to(torch.float32)
        if scale != 1.0:
            up_TK = up_TK * scale
        kept_TK = pos_TK >= 0
        if normalize == "after_drop":
            h_TK = gate_TK * kept_TK
            total_T1 = h_TK.sum(-1, keepdim=True)
            n_T1 = total_T1.clamp(min=EPS)
            inner_T1 = (up_TK * h_TK).sum(-1, keepdim=True) / (n_T1 * n_T1) * (total_T1 > EPS)
            grad_g_TK = (up_TK / n_T1 - inner_T1) * kept_TK
        else:
            grad_g_TK = up_TK * kept_TK
        if normalize == "before_drop":
            p_TK = probs_TE.gather(1, expert_TK)
            s_T1 = p_TK.sum(-1, keepdim=True).clamp(min=TINY)
            grad_g_TK = grad_g_TK / s_T1 - (grad_g_TK * p_TK).sum(-1, keepdim=True) / (s_T1 * s_T1)
        grad_TE = torch.zeros_like(probs_TE).scatter_(1, expert_TK, grad_g_TK)
    if grad_aux is not None:
        loss_E = grad_aux.to(torch.float32) * aux_grad_E
        grad_TE = loss_E.expand_as(probs_TE) if grad_TE is None else grad_TE.add_(loss_E)
    grad_logits_TE = torch._softmax_backward_data(grad_TE, probs_TE, -1, torch.float32)
    if grad_aux is not None and lse_T is not None:
        grad_logits_TE += (grad_aux.to(torch.float32) * (2 * z_scale)) * lse_T[:, None] * probs_TE
    return grad_logits_TE


def _native(device: torch.device):
    """The native CPU kernels where they load (route_backward), else None: the torch ops above."""
    module, name, _ = kernels_for(device)
    return module if name == "native" and hasattr(module, "route_plan") else None
