"""Stacked expert FFN weights and their compute on the routed rows only.

Legend: R routed rows (grouped by expert), D model dim, H expert hidden dim, E experts.
With swiglu the first projection gives 2H columns: [gate | up].
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig


def _swiglu(pre_RH2: torch.Tensor) -> torch.Tensor:
    gate_RH, up_RH = pre_RH2.chunk(2, dim=-1)
    return F.silu(gate_RH) * up_RH


ACTIVATIONS = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "swiglu": _swiglu}


def activate(pre_RH: torch.Tensor, activation: str):
    """(activations, what backward needs): relu works in place and keeps its output as its own
    mask; the others keep the pre-activation and recompute in backward."""
    if activation == "relu":
        act_RH = pre_RH.relu_()
        return act_RH, act_RH
    return ACTIVATIONS[activation](pre_RH), pre_RH


def activation_backward(saved_RH: torch.Tensor, activation: str):
    """From what activate() kept: the activations, and grad(activations) -> grad(pre-activation)."""
    if activation == "relu":
        return saved_RH, lambda grad_RH: torch.ops.aten.threshold_backward.grad_input(
            grad_RH, saved_RH, 0, grad_input=grad_RH)
    with torch.enable_grad():
        pre_RH = saved_RH.detach().requires_grad_()
        act_RH = ACTIVATIONS[activation](pre_RH)
    return act_RH.detach(), lambda grad_RH: torch.autograd.grad(act_RH, pre_RH, grad_RH)[0]


def _linear_into(out_RO, x_RI, weight_EIO, bias_EO, rows_per_expert):
    blocks = zip(out_RO.split(rows_per_expert), x_RI.split(rows_per_expert), weight_EIO.unbind(0))
    for e, (out_NO, x_NI, weight_IO) in enumerate(blocks):
        if x_NI.shape[0]:
            torch.mm(x_NI, weight_IO, out=out_NO)
            if bias_EO is not None:  # a separate add is cheaper than addmm's copy of the bias on CPU
                out_NO.add_(bias_EO[e])
    return out_RO


def _weight_grads(x_RI, grad_RO, weight_EIO, with_bias, rows_per_expert):
    """Per expert: grad_W = x^T grad, grad_b = sum of grad rows. Experts with no rows get zeros."""
    grad_w_EIO = torch.empty_like(weight_EIO)
    grad_b_EO = weight_EIO.new_empty(weight_EIO.shape[0], weight_EIO.shape[2]) if with_bias else None
    blocks = zip(x_RI.split(rows_per_expert), grad_RO.split(rows_per_expert), grad_w_EIO.unbind(0))
    for e, (x_NI, grad_NO, grad_w_IO) in enumerate(blocks):
        if x_NI.shape[0]:
            torch.mm(x_NI.t(), grad_NO, out=grad_w_IO)
        else:
            grad_w_IO.zero_()
        if with_bias:
            torch.sum(grad_NO, dim=0, out=grad_b_EO[e])
    return grad_w_EIO, grad_b_EO


def _input_grad(grad_RO, weight_EIO, rows_per_expert):
    grad_RI = grad_RO.new_empty(grad_RO.shape[0], weight_EIO.shape[1])
    blocks = zip(grad_RI.split(rows_per_expert), grad_RO.split(rows_per_expert), weight_EIO.unbind(0))
    for grad_NI, grad_NO, weight_IO in blocks:
        if grad_NO.shape[0]:
            torch.mm(grad_NO, weight_IO.t(), out=grad_NI)
    return grad_RI


class GroupedMLP(torch.autograd.Function):
    """y = act(x W1[e] + b1[e]) W2[e] + b2[e] for each expert's block of rows."""

    @staticmethod
    def forward(ctx, x_RD, rows_per_expert, activation, w1_EDH, b1_EH, w2_EHD, b2_ED):
        x_RD = x_RD.contiguous()
        pre_RH = _linear_into(x_RD.new_empty(x_RD.shape[0], w1_EDH.shape[2]), x_RD, w1_EDH, b1_EH, rows_per_expert)
        act_RH, saved_RH = activate(pre_RH, activation)
        y_RD = _linear_into(x_RD.new_empty(x_RD.shape[0], w2_EHD.shape[2]), act_RH, w2_EHD, b2_ED, rows_per_expert)
        ctx.save_for_backward(x_RD, saved_RH, w1_EDH, w2_EHD)
        ctx.rows_per_expert, ctx.activation = rows_per_expert, activation
        ctx.bias1, ctx.bias2 = b1_EH is not None, b2_ED is not None
        return y_RD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_RD):
        x_RD, saved_RH, w1_EDH, w2_EHD = ctx.saved_tensors
        rows = ctx.rows_per_expert
        grad_y_RD = grad_y_RD.contiguous()
        act_RH, pre_grad = activation_backward(saved_RH, ctx.activation)
        grad_pre_RH = pre_grad(_input_grad(grad_y_RD, w2_EHD, rows))
        grad_w2, grad_b2 = _weight_grads(act_RH, grad_y_RD, w2_EHD, ctx.bias2, rows)
        grad_w1, grad_b1 = _weight_grads(x_RD, grad_pre_RH, w1_EDH, ctx.bias1, rows)
        grad_x_RD = _input_grad(grad_pre_RH, w1_EDH, rows) if ctx.needs_input_grad[0] else None
        return grad_x_RD, None, None, grad_w1, grad_b1, grad_w2, grad_b2


class Experts(nn.Module):
    """This rank's experts, stacked: w1_EDH [E_local, D, H_local (x2 for swiglu)], w2_EHD [E_local, H_local, D].

    Each expert is drawn from its own generator (seeded from the global RNG and the expert's index), so
    the same seed gives the same experts whatever the ep_size; a rank keeps only its share.
    """

    def __init__(self, config: MoEConfig, first_expert: int = 0, local_experts: Optional[int] = None,
                 slices: int = 1, slice_index: int = 0):
        super().__init__()
        D, H = config.model_dim, config.hidden_size
        local_experts = config.num_experts if local_experts is None else local_experts
        self.activation = config.activation
        self.slices, self.slice_index = slices, slice_index
        base_seed = int(torch.randint(0, 2**62, ()))
        weights = [self.full_expert(config, base_seed + first_expert + i) for i in range(local_experts)]
        shards = [self.take_slice(w, slices, slice_index) for w in weights]
        self.w1_EDH = nn.Parameter(torch.stack([w["w1"] for w in shards]))
        self.w2_EHD = nn.Parameter(torch.stack([w["w2"] for w in shards]))
        self.b1_EH = nn.Parameter(torch.stack([w["b1"] for w in shards])) if config.bias else None
        self.b2_ED = nn.Parameter(torch.stack([w["b2"] for w in shards])) if config.bias else None

    @staticmethod
    def full_expert(config: MoEConfig, seed: int) -> dict:
        D, H = config.model_dim, config.hidden_size
        first_out = 2 * H if config.activation == "swiglu" else H
        generator = torch.Generator().manual_seed(seed)
        return {"w1": _uniform(D, first_out, fan_in=D, generator=generator),
                "b1": _uniform(first_out, fan_in=D, generator=generator),
                "w2": _uniform(H, D, fan_in=H, generator=generator),
                "b2": _uniform(D, fan_in=H, generator=generator)}

    @staticmethod
    def take_slice(expert: dict, slices: int, index: int) -> dict:
        """Hidden slice `index` of `slices` of one expert's tensors (swiglu's [gate | up] sliced alike)."""
        if slices == 1:
            return expert
        hidden = expert["w2"].shape[0]

        def hidden_cols(t):
            halves = t.chunk(2, dim=-1) if t.shape[-1] == 2 * hidden else (t,)
            return torch.cat([h.chunk(slices, dim=-1)[index] for h in halves], dim=-1)
        shard = {"w1": hidden_cols(expert["w1"]), "w2": expert["w2"].chunk(slices, dim=0)[index]}
        if "b1" in expert:
            shard.update(b1=hidden_cols(expert["b1"]), b2=expert["b2"])
        return shard

    def forward(self, x_RD: torch.Tensor, rows_per_expert: List[int]) -> torch.Tensor:
        return GroupedMLP.apply(x_RD, rows_per_expert, self.activation,
                                self.w1_EDH, self.b1_EH, self.w2_EHD, self.b2_ED)


def _uniform(*shape: int, fan_in: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(*shape).uniform_(-bound, bound, generator=generator)
