"""The single-process fast path: encode, expert FFN and decode in one autograd function.

The routed inputs [R, D] are gathered (into pooled memory on CPU), run through the experts with two
grouped GEMMs, and one gather_sum kernel weights the expert outputs and adds them into the tokens.
Backward keeps no [R, D] tensor from forward: only the activations' input (the pre-activation, or
relu's output); the gate gradient <grad_y, expert output> comes from the down projection's dgrad and
the activations (experts.mlp_backward), and the routed inputs are gathered again for the first
weight gradient (or read from x by index where that kernel measured faster: ops/fused_gemms.py).
Shapes are static (R = T*K, offsets on the device): no host synchronization, so torch.compile
captures it whole. Matches dispatch.encode -> GroupedMLP -> dispatch.decode.

Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, H expert hidden dim, E experts, K top-k, R routed
rows, Q LoRA rank).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import experts, ops
from ..experts import Needs, mlp_backward, mlp_forward
from ..ops import fused_gemms


def fused_moe(*args) -> torch.Tensor:
    """FusedMoE.apply(*args); where no autograd graph is recorded (no_grad, inference_mode: generation) and no
    compiler or functorch transform must see the function, its forward itself: apply's host work buys nothing."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or \
            torch._C._functorch.peek_interpreter_stack() is not None:
        return FusedMoE.apply(*args)
    return FusedMoE.forward(NoGraph(), *args)


class NoGraph:
    """The ctx an autograd function's forward gets where it runs outside Function.apply (no graph recorded):
    takes what forward stores and keeps no tensor."""

    def save_for_backward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


class FusedMoE(torch.autograd.Function):
    """With LoRA factors (up_a_EDQ, up_b_EQH, down_a_EHQ, down_b_EQD; B times its scale; a pair may be None) their
    low-rank terms run on the routed rows too (experts.mlp_forward). Backward computes only the gradients
    asked for: frozen expert weights cost no weight-gradient GEMM, and an input that needs no gradient
    none of the input-gradient GEMMs."""

    @staticmethod
    def forward(ctx, *args):
        if torch.compiler.is_compiling():    # the ops run later, in the compiled graph: they zero as usual
            return FusedMoE._forward(ctx, *args)
        # rows past the kept ones: every consumer here skips them, none is zeroed; the kernels looked up once
        with ops.fused_call(*args[:4], *args[5:13]):     # the tensors (or None): all but activation and recompute
            return FusedMoE._forward(ctx, *args)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_TD):
        saved = ctx.saved_tensors     # unpacked once (activation checkpointing allows no second unpack)
        if torch.compiler.is_compiling():
            return FusedMoE._backward(ctx, grad_y_TD, saved)
        with ops.fused_call(grad_y_TD, *saved):
            return FusedMoE._backward(ctx, grad_y_TD, saved)

    @staticmethod
    def _forward(ctx, x_TD, gate_TK, pos_TK, offs_E, activation: str, w1_EDH, b1_EH, w2_EHD, b2_ED,
                 up_a_EDQ=None, up_b_EQH=None, down_a_EHQ=None, down_b_EQD=None, recompute: bool = False):
        y_TD, saved = experts_forward(x_TD, gate_TK, pos_TK, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED,
                                      (up_a_EDQ, up_b_EQH, down_a_EHQ, down_b_EQD), recompute)
        ctx.save_for_backward(*saved)
        ctx.activation = activation
        ctx.bias1, ctx.bias2 = b1_EH is not None, b2_ED is not None
        return y_TD

    @staticmethod
    def _backward(ctx, grad_y_TD, saved):
        needs = Needs.of(ctx.needs_input_grad, x=0, weights=5)
        gate_grad = ctx.needs_input_grad[1]
        if not (any(needs) or gate_grad):
            return (None,) * (5 + len(Needs._fields))     # x, gate, pos, offsets, activation, 8 weights, recompute
        grad_x_TD, grad_gate_R, weight_grads = experts_backward(grad_y_TD, saved, ctx.activation, ctx.bias1,
                                                                ctx.bias2, needs, gate_grad)
        gate_TK, pos_TK = saved[2], saved[3]
        grad_gate_TK = choices_of_rows(grad_gate_R.to(gate_TK.dtype), pos_TK) if gate_grad else None
        return (grad_x_TD, grad_gate_TK, None, None, None, *weight_grads, None)


def experts_forward(x_TD, gate_TK, pos_TK, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED, lora: tuple,
                    recompute: bool):
    """(y_TD, saved): FusedMoE's forward; saved, what experts_backward takes (x_TD, saved_RH, gate_TK, pos_TK, offs_E,
    w1_EDH, w2_EHD, b2_ED, xa_RQ, ha_RQ, b1_EH where recompute, then the four LoRA factors)."""
    x_TD = x_TD.contiguous()
    R = pos_TK.numel()
    # the first projection on x's rows read by index, where that kernel runs and measured faster
    up = fused_gemms.gather_up(x_TD, pos_TK, offs_E, activation, w1_EDH, b1_EH) if lora[0] is None else None
    x_RD = ops.scatter_rows(x_TD, pos_TK, None, None, R)[0] if up is None else None
    expert_y_RD, saved_RH, xa_RQ, ha_RQ = mlp_forward(x_RD, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED,
                                                      lora, up)
    del x_RD, up
    y_TD = ops.gather_sum(expert_y_RD, pos_TK, gate_TK, None)[0]
    del expert_y_RD

    if recompute:       # backward runs the first projection again from x's rows
        saved_RH = xa_RQ = None
    return y_TD, (x_TD, saved_RH, gate_TK, pos_TK, offs_E, w1_EDH, w2_EHD, b2_ED, xa_RQ, ha_RQ,
                  b1_EH if recompute else None, *lora)


def experts_backward(grad_y_TD, saved, activation, bias1: bool, bias2: bool, needs: Needs, gate_grad: bool,
                     gate_R1: Optional[torch.Tensor] = None):
    """(grad_x_TD or None, grad_gate_R [R] in fp32 (each routed row's gate gradient) or None, the 8 weight
    gradients): FusedMoE's backward from experts_forward's saved; gate_R1 [R, 1], each row's gate, where the caller
    has it (else it is scattered from the gates)."""
    x_TD, saved_RH, gate_TK, pos_TK, offs_E, w1_EDH, w2_EHD, b2_ED, xa_RQ, ha_RQ, b1_EH, *lora = saved
    R = pos_TK.numel()
    if saved_RH is None:
        saved_RH, xa_RQ = recomputed_up(x_TD, pos_TK, offs_E, activation, w1_EDH, b1_EH, *lora[:2])

    # every routed row's output gradient: scaled by its gate here, or (for the gate gradient) in mlp_backward
    grad_RD = ops.scatter_rows(grad_y_TD.contiguous(), pos_TK, None if gate_grad else gate_TK, None, R)[0]
    if gate_grad and gate_R1 is None:
        gate_R1 = rows_of_choices(gate_TK, pos_TK, R).unsqueeze(1)
    grad_x_RD, *weight_grads, grad_gate_R = mlp_backward(
        grad_RD, saved_RH, offs_E, activation, w1_EDH, w2_EHD, bias1, bias2,
        fused_gemms.RoutedRows(x_TD, pos_TK, R), needs, tuple(lora), xa_RQ, ha_RQ,
        gate_R1 if gate_grad else None, b2_ED if bias2 else None)
    grad_x_TD = ops.gather_sum(grad_x_RD, pos_TK, None, None)[0] if needs.x else None
    return grad_x_TD, grad_gate_R, weight_grads


def recomputed_up(x_TD, pos_TK, offs_E, activation, w1_EDH, b1_EH, up_a_EDQ, up_b_EQH):
    """(saved_RH, xa_RQ): what FusedMoE's forward computed of the first projection on x's routed rows, again."""
    up = fused_gemms.gather_up(x_TD, pos_TK, offs_E, activation, w1_EDH, b1_EH) if up_a_EDQ is None else None
    if up is not None:
        return up[1], None
    x_RD = ops.scatter_rows(x_TD, pos_TK, None, None, pos_TK.numel())[0]
    return experts.recomputed_up(x_RD, offs_E, activation, w1_EDH, b1_EH, up_a_EDQ, up_b_EQH)


def rows_of_choices(values_TK: torch.Tensor, pos_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """values_R[pos_TK[t, k]] = values_TK[t, k] for kept choices (the routing's scatter of a column of ones, scaled:
    one launch, no host sync); the rows no choice names are unspecified (no consumer reads them)."""
    return ops.scatter_rows(ops.ones_column(values_TK, pos_TK.shape[0]), pos_TK, values_TK, None,
                            num_rows)[0].squeeze(1)


def choices_of_rows(values_R: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """values_TK[t, k] = values_R[pos_TK[t, k]], 0 for dropped choices (gather_sum's dot with a column of ones)."""
    return ops.gather_sum(values_R.unsqueeze(1), pos_TK, None, ops.ones_column(values_R, pos_TK.shape[0]))[1]
