"""The whole single-process step as one autograd node on the CUDA path (eager, the Triton kernels): the fused
routing's kernels (ops/triton_route.py) and the expert FFN on the routed rows (fused.experts_forward and
experts_backward, what FusedMoE runs), in one Function.apply and one backward node. Against fused_route.route
followed by the local dispatcher's FusedMoE (which stays the reference the tests compare this path with, and the
path everywhere else) a step has one autograd node and four launches less: the routing writes each row's final
gate for backward (no scatter of the gates there), backward hands the gates' gradient to the routing's backward by
row (no gather back to choices, no cast), and the router's input gradient is added into the experts' by its GEMM
(no add). Where a step is short its time is host work, per launch (issue 33's host time; the CPU twin is
one_process/node_cpu.py).

It takes (eligible): eager CUDA with the Triton kernels (or that path simulated on CPU: ops.simulated_cuda), the
router fused_route covers, stacked experts without LoRA on one process. Under autocast the layer hands it x in the
autocast dtype (the experts' input) and x as given (the router's, fp32), as two inputs.

Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, H expert hidden dim, E experts, K top-k, R routed
rows).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch, ops
from . import fused_route
from ..dispatchers.local import LocalDispatcher
from ..experts import NO_LORA, Needs
from .fused_experts import NoGraph, experts_backward, experts_forward
from ..ops.choice import eager_triton, triton_modules

ENABLED = True      # tests turn it off to get the reference path


def kernels(x_TD: torch.Tensor):
    """The Triton routing module where this path may run for x_TD (eager CUDA with the Triton kernels, or that path
    simulated on CPU; no dispatch mode or transform that must see each op), else None."""
    if not ENABLED or eager_triton(x_TD.device) is None or not fused_route._plain_dispatch():
        return None
    return triton_modules()[1]


def eligible(layer, x_TD: torch.Tensor, routed_TD: torch.Tensor, weights) -> bool:
    """Whether this path computes what fused_route.route and the local dispatcher would, where
    fused_route.routed_as_configured(layer, routed_TD) holds (weights: the experts' ExpertWeights in the experts'
    dtype, or None)."""
    if weights is None or weights.has_lora:
        return False
    return isinstance(layer._dispatcher, LocalDispatcher) and type(x_TD) in _PLAIN and type(routed_TD) in _PLAIN


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def moe(layer, x_TD: torch.Tensor, routed_TD: Optional[torch.Tensor], weights, capacity_factor: float, route):
    """(y_TD, aux loss, plan) of the layer on x_TD (in the experts' dtype); routed_TD: what the router sees, if not
    x_TD; route: kernels()."""
    spec, cap, fixed = fused_route.route_spec(layer.config, x_TD.shape[0], capacity_factor, x_TD.dtype)
    spec += (weights.activation, weights.recompute, route)
    # the routing writes the loads, kept rows and aux value into the layer's persistent stats (as fused_route.route)
    stats = (*layer._stats_rows, layer._aux_value) if layer._stats_2E.device == x_TD.device else None
    plan = []       # forward puts the plan's tensors here: as outputs each would cost autograd's bookkeeping
    args = (x_TD, routed_TD, layer.router.weight_ED, weights.w1_EDH, weights.b1_EH, weights.w2_EHD, weights.b2_ED,
            spec, stats, plan)
    y_TD, aux = FusedLayerCUDA.apply(*args) if torch.is_grad_enabled() else FusedLayerCUDA.forward(NoGraph(), *args)
    return y_TD, aux, dispatch.Plan(*plan, cap, capacity_factor, fixed)


class FusedLayerCUDA(torch.autograd.Function):
    """Inputs: x_TD, routed_TD (None: x_TD itself), the router's weight_ED, w1_EDH, b1_EH, w2_EHD, b2_ED, spec, stats
    (the layer's loads, kept rows and aux value to write, or None), and plan: an empty list that forward fills with
    the plan's tensors (pos_TK, kept_TK, load_E, kept_E, offs_E). Outputs: y_TD, aux. Backward computes only the
    gradients asked for."""

    @staticmethod
    def forward(ctx, x_TD, routed_TD, w_ED, w1_EDH, b1_EH, w2_EHD, b2_ED, spec, stats, plan):
        route_spec, (activation, recompute, route) = spec[:8], spec[8:]     # fused_route.route_spec's, then ours
        K, dtype = route_spec[0], route_spec[7]
        x_TD, w_ED = x_TD.contiguous(), w_ED.contiguous()
        router_TD = x_TD if routed_TD is None else routed_TD.contiguous()
        final_R = route._empty((x_TD.shape[0] * K,), dtype, x_TD.device)   # each kept row's gate, for backward
        (final_TK, aux, pos_TK, kept_TK, load_E, kept_E, offs_E), (expert_TK, gate_TK, probs_TE, lse_T, aux_grad_E) = \
            route.route(router_TD, w_ED, *route_spec, stats=stats or (), final_R=final_R)
        with ops.fused_call(x_TD, w1_EDH, b1_EH, w2_EHD, b2_ED):
            y_TD, saved = experts_forward(x_TD, final_TK, pos_TK, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED,
                                          NO_LORA, recompute)
        ctx.save_for_backward(routed_TD, w_ED, expert_TK, gate_TK, probs_TE, lse_T, aux_grad_E, final_R, *saved)
        ctx.spec, ctx.bias1, ctx.bias2 = spec, b1_EH is not None, b2_ED is not None
        ctx.set_materialize_grads(False)
        plan.extend((pos_TK, kept_TK, load_E, kept_E, offs_E))
        return y_TD, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_TD, grad_aux):
        routed_TD, w_ED, expert_TK, gate_TK, probs_TE, lse_T, aux_grad_E, final_R, *saved = ctx.saved_tensors
        K, normalize, scale, cap, aux_kind, aux_scale, z_scale, dtype, activation, recompute, route = ctx.spec
        need_x, need_routed, need_wr = ctx.needs_input_grad[:3]
        needs = Needs(need_x, *ctx.needs_input_grad[3:7], False, False, False, False)
        x_TD, pos_TK = saved[0], saved[3]
        router_TD = x_TD if routed_TD is None else routed_TD
        router_grad = need_wr or need_routed or (routed_TD is None and need_x)
        grads = [None] * 10
        grad_gate_R = None
        with ops.fused_call(x_TD, *saved[1:]):
            if grad_y_TD is not None and (any(needs) or router_grad):
                grads[0], grad_gate_R, weight_grads = experts_backward(
                    grad_y_TD, saved, activation, ctx.bias1, ctx.bias2, needs, router_grad, final_R.unsqueeze(1))
                grads[3:7] = weight_grads[:4]
            if router_grad and (grad_gate_R is not None or grad_aux is not None):
                grad_TE = route.route_backward(grad_gate_R, grad_aux, expert_TK, gate_TK, pos_TK, probs_TE, lse_T,
                                               aux_grad_E, normalize, scale, z_scale, router_TD.dtype, by_row=True)
                if routed_TD is None and need_x and grads[0] is not None:
                    grads[0].addmm_(grad_TE, w_ED)      # the router's share of x's gradient, added by the GEMM
                elif need_routed or (routed_TD is None and need_x):
                    grads[0 if routed_TD is None else 1] = grad_TE @ w_ED
                if need_wr:
                    grads[2] = grad_TE.t() @ router_TD
        return tuple(grads)
