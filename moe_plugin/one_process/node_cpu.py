"""The whole single-process step as one autograd node on CPU: the fused routing (ops/torch_route.py) and the
expert FFN on the routed rows (what one_process/fused_experts.py's FusedMoE computes), with the native kernels (csrc/) bound once per
call and called directly. Where a step is short its time is host work, and here it goes into one Function.apply,
one backward node and plain kernel calls: no gate tensor crosses between two nodes, no kernel-choice look-up or
custom-op dispatch runs per kernel (issue 33's host time).

It takes what fused_route.route and fused_moe take together (eligible): eager CPU with the native kernels, the
router fused_route covers, stacked experts without LoRA on one process, fp32 or bf16 outside autocast, widths the
grouped GEMM takes as they are (rows of 16 bytes). Everything else runs fused_route -> dispatcher, which stays the
reference the tests compare this path with.

Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, H expert hidden dim, F the first projection's
width (2H gated), E experts, K top-k, R routed rows).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch, ops
from . import fused_route
from ..activations import activate, activation_backward, kept
from ..dispatchers.local import LocalDispatcher
from ..experts import weight_grad
from .fused_experts import NoGraph
from ..ops import grouped_sum, torch_route
from ..ops.grouped import add_bias
from ..ops.choice import device_kind, kernels_for

DTYPES = (torch.float32, torch.bfloat16)
ENABLED = True      # tests turn it off to get the reference path


def kernels(x_TD: torch.Tensor):
    """The native kernel module where this path may run for x_TD (eager CPU, native kernels, plain tensors, no
    dispatch mode or transform that must see each op), else None."""
    if not ENABLED or device_kind(x_TD.device) != "cpu" or torch.compiler.is_compiling() or \
            torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None:
        return None
    module, name, _ = kernels_for(x_TD.device)
    return module if name == "native" else None


def eligible(layer, x_TD: torch.Tensor, routed_TD: torch.Tensor, weights) -> bool:
    """Whether this path computes what fused_route.route and the local dispatcher would, where
    fused_route.routed_as_configured(layer, routed_TD) holds (weights: the experts' ExpertWeights in x's dtype, or
    None)."""
    if weights is None or weights.has_lora or \
            x_TD.dtype not in DTYPES or not isinstance(layer._dispatcher, LocalDispatcher):
        return False
    align = 16 // x_TD.element_size()
    w1, w2 = weights.w1_EDH, weights.w2_EHD
    return type(x_TD) in _PLAIN and type(routed_TD) in _PLAIN and type(w1) in _PLAIN and type(w2) in _PLAIN and \
        x_TD.shape[1] % align == 0 and w1.shape[2] % align == 0 and w2.shape[1] % align == 0


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def moe(layer, x_TD: torch.Tensor, routed_TD: Optional[torch.Tensor], weights, capacity_factor: float, native):
    """(y_TD, aux loss, plan) of the layer on x_TD; routed_TD: what the router sees, if not x_TD."""
    spec, cap, fixed = fused_route.route_spec(layer.config, x_TD.shape[0], capacity_factor, x_TD.dtype)
    spec += (weights.activation, native, weights.recompute)
    plan = []       # forward puts the plan's tensors here: as outputs each would cost autograd's bookkeeping
    args = (x_TD, routed_TD, layer.router.weight_ED, weights.w1_EDH, weights.b1_EH, weights.w2_EHD, weights.b2_ED,
            spec, plan)
    y_TD, aux = FusedLayer.apply(*args) if torch.is_grad_enabled() else FusedLayer.forward(NoGraph(), *args)
    return y_TD, aux, dispatch.Plan(*plan, cap, capacity_factor, fixed)


class FusedLayer(torch.autograd.Function):
    """Inputs: x_TD, routed_TD (None: x_TD itself), the router's weight_ED, w1_EDH, b1_EH, w2_EHD, b2_ED, spec, and
    plan: an empty list that forward fills with the plan's tensors (pos_TK, kept_TK, load_E, kept_E, offs_E).
    Outputs: y_TD, aux. Backward computes only the gradients asked for."""

    @staticmethod
    def forward(ctx, x_TD, routed_TD, w_ED, w1_EDH, b1_EH, w2_EHD, b2_ED, spec, plan):
        K, normalize, scale, cap, aux_kind, aux_scale, z_scale, dtype, activation, native, recompute = spec
        x_TD = x_TD.contiguous()
        router_TD = x_TD if routed_TD is None else routed_TD.contiguous()
        outputs, routes = torch_route.route(router_TD, w_ED.contiguous(), K, normalize, scale, cap, aux_kind,
                                            aux_scale, z_scale, dtype, native)
        gate_TK, aux, pos_TK, kept_TK, load_E, kept_E, offs_E = outputs
        R = pos_TK.numel()
        # rows past the kept ones (dropped choices) stay as they come: every kernel below reads only kept rows
        x_RD = native.scatter_rows(x_TD, pos_TK, None, None, R)[0]
        pre_RF = _grouped_mm(native, x_RD, w1_EDH, offs_E, b1_EH)
        del x_RD
        act_RH, saved_RF = _activate(native, pre_RF, activation)
        del pre_RF
        y_RD = _grouped_mm(native, act_RH, w2_EHD, offs_E, b2_ED)
        del act_RH
        y_TD = native.gather_sum(y_RD, pos_TK, gate_TK, None)[0]
        del y_RD

        if recompute:       # backward runs the first projection again from x's rows
            saved_RF = None
        ctx.save_for_backward(x_TD, routed_TD, w_ED, w1_EDH, b1_EH if recompute else None, w2_EHD, b2_ED, saved_RF,
                              gate_TK, pos_TK, offs_E, *routes)
        ctx.spec, ctx.bias1 = spec, b1_EH is not None
        ctx.set_materialize_grads(False)
        plan.extend((pos_TK, kept_TK, load_E, kept_E, offs_E))
        return y_TD, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_TD, grad_aux):
        (x_TD, routed_TD, w_ED, w1_EDH, b1_EH, w2_EHD, b2_ED, saved_RF, gate_TK, pos_TK, offs_E,
         expert_TK, route_gate_TK, probs_TE, lse_T, aux_grad_E) = ctx.saved_tensors
        K, normalize, scale, cap, aux_kind, aux_scale, z_scale, dtype, activation, native, _ = ctx.spec
        need_x, need_routed, need_wr, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:7]
        router_grad = need_wr or need_routed or (routed_TD is None and need_x)
        grads = [None] * 9
        R = pos_TK.numel()

        grad_gate_TK = x_RD = None
        if grad_y_TD is not None:
            if saved_RF is None:      # recompute "experts": the first projection again (its rows kept for w1's grad)
                x_RD = native.scatter_rows(x_TD, pos_TK, None, None, R)[0]
                saved_RF = kept(_grouped_mm(native, x_RD, w1_EDH, offs_E, b1_EH), activation)
            grad_y_TD = grad_y_TD.contiguous()
            # the rows' output gradient, before the gate scales it when the gate's own gradient is asked for
            grad_RD = native.scatter_rows(grad_y_TD, pos_TK, None if router_grad else gate_TK, None, R)[0]
            below = need_x or need_w1 or need_b1
            act_RH = grad_pre_RF = None
            if below or router_grad:
                grad_act_RH = _grouped_mm(native, grad_RD, w2_EHD.transpose(1, 2), offs_E)
                act_RH, grad_pre_RF = _activation_backward(native, saved_RF, grad_act_RH, activation)
                if router_grad:
                    gate_R1 = native.scatter_rows(gate_TK.new_ones(pos_TK.shape[0], 1), pos_TK, gate_TK, None, R)[0]
                    grad_gate_R = torch.linalg.vecdot(grad_act_RH.float(), act_RH.float()) \
                        if grad_act_RH.dtype != torch.float32 else torch.linalg.vecdot(grad_act_RH, act_RH)
                    if b2_ED is not None:     # the second bias is part of the expert output the gate scales
                        grad_gate_R += ops.grouped_mm(grad_RD, b2_ED.unsqueeze(2), offs_E).squeeze(1)
                    grad_RD.mul_(gate_R1)
                    grad_pre_RF.mul_(gate_R1)
                    grad_gate_R = grad_gate_R.to(gate_TK.dtype)
                    if cap >= R:    # dropless: every choice has its row
                        grad_gate_TK = grad_gate_R.index_select(0, pos_TK.view(-1)).view(pos_TK.shape)
                    else:
                        ones_T1 = grad_gate_R.new_ones(pos_TK.shape[0], 1)
                        grad_gate_TK = native.gather_sum(grad_gate_R.unsqueeze(1), pos_TK, None, ones_T1)[1]
                del grad_act_RH
            elif need_w2:
                act_RH = _activate(native, saved_RF, activation)[0]
            if need_w2:
                grads[5] = weight_grad(act_RH, grad_RD, offs_E, w2_EHD, native.grouped_mm)
            if need_b2 and b2_ED is not None:
                grads[6] = grouped_sum(grad_RD, offs_E)
            del act_RH, grad_RD
            if need_w1:
                if x_RD is None:
                    x_RD = native.scatter_rows(x_TD, pos_TK, None, None, R)[0]
                grads[3] = weight_grad(x_RD, grad_pre_RF, offs_E, w1_EDH, native.grouped_mm)
            del x_RD
            if need_b1 and ctx.bias1:
                grads[4] = grouped_sum(grad_pre_RF, offs_E)
            if need_x:
                grad_x_RD = _grouped_mm(native, grad_pre_RF, w1_EDH.transpose(1, 2), offs_E)
                grads[0] = native.gather_sum(grad_x_RD, pos_TK, None, None)[0]

        if router_grad and (grad_gate_TK is not None or grad_aux is not None):
            grad_TE = torch_route.route_backward(grad_gate_TK, grad_aux, expert_TK, route_gate_TK, pos_TK, probs_TE,
                                                 lse_T, aux_grad_E, normalize, scale, z_scale, dtype, native)
            router_TD = x_TD if routed_TD is None else routed_TD
            if need_routed or (routed_TD is None and need_x):
                grad_router_TD = (grad_TE @ w_ED.to(grad_TE.dtype)).to(router_TD.dtype)
                if routed_TD is not None:
                    grads[1] = grad_router_TD
                else:
                    grads[0] = grad_router_TD if grads[0] is None else grads[0].add_(grad_router_TD)
            if need_wr:
                grads[2] = (grad_TE.t() @ router_TD.to(grad_TE.dtype)).to(w_ED.dtype)
        return tuple(grads)


def _grouped_mm(native, a_RI: torch.Tensor, b_EIO: torch.Tensor, offs_E: torch.Tensor,
                bias_EO: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[R, O]: each group's rows times its b (+ its bias); rows past the last group unspecified."""
    out_RO = native.grouped_mm(a_RI, b_EIO, offs_E)
    if bias_EO is not None:
        add_bias(out_RO, bias_EO, offs_E)
    return out_RO


def _activate(native, pre_RF: torch.Tensor, activation):
    """(act_RH, what backward needs): activations.activate, SwiGLU's one-pass kernel called directly."""
    if activation.name == "swiglu" and activation.limit is None:
        return native.swiglu_forward(pre_RF), pre_RF
    return activate(pre_RF, activation)


def _activation_backward(native, saved_RF: torch.Tensor, grad_act_RH: torch.Tensor, activation):
    """(act_RH, grad_pre_RF): activations.activation_backward, SwiGLU's one-pass kernel called directly (its in-place
    form, activation_backward_, measured 60 us slower per tiny step here)."""
    if activation.name == "swiglu" and activation.limit is None:
        grad_pre_RF, act_RH = native.swiglu_backward(grad_act_RH, saved_RF)
        return act_RH, grad_pre_RF
    return activation_backward(saved_RF, grad_act_RH, activation)
