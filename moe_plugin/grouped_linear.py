"""One grouped linear layer with autograd: y = x W[e] (+ b[e]) on each expert's block of rows.

experts.GroupedMLP fuses a whole expert FFN with a fixed set of activations; this single GEMM lets a
caller put any differentiable function between two of them (a host framework's own gate or norm).

Shape legend: moe_plugin/__init__.py (here R routed rows (grouped by expert), I input dim, O output dim, E experts).
"""
from __future__ import annotations

import torch

from . import ops
from .experts import weight_grad


class GroupedLinear(torch.autograd.Function):
    """x_RI [R, I], w_EIO [E, I, O], b_EO [E, O] or None, offs_E the end row of each expert's block
    (int32, on the rows' device) -> y_RO; rows past the last offset give 0 (and get 0 gradient)."""

    @staticmethod
    def forward(ctx, x_RI, w_EIO, b_EO, offs_E):
        x_RI = x_RI.contiguous()
        ctx.save_for_backward(x_RI if ctx.needs_input_grad[1] else None, w_EIO, offs_E)   # x: for w's gradient only
        ctx.bias = b_EO is not None
        return ops.grouped_mm(x_RI, w_EIO, offs_E, b_EO)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RO):
        x_RI, w_EIO, offs_E = ctx.saved_tensors
        grad_RO = grad_RO.contiguous()
        grad_x = ops.grouped_mm(grad_RO, w_EIO.transpose(1, 2), offs_E) if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(x_RI, grad_RO, offs_E, w_EIO) if ctx.needs_input_grad[1] else None
        grad_b = ops.grouped_sum(grad_RO, offs_E) if ctx.bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def grouped_linear(x_RI: torch.Tensor, w_EIO: torch.Tensor, offs_E: torch.Tensor, b_EO=None) -> torch.Tensor:
    return GroupedLinear.apply(x_RI, w_EIO, b_EO, offs_E)
