"""The single-process fast path: encode, expert FFN and decode fused, one expert block at a time.

Each expert's tokens are gathered into a small reused buffer and run through the expert; the
expert outputs [R, D] are kept (the gate gradient needs them) and one gather_sum kernel weights
and adds them into the tokens. The routed inputs [R, D] are never materialized (the backward
pass gathers them again). Matches dispatch.encode -> GroupedMLP -> dispatch.decode.

Legend: T tokens, D model dim, H expert hidden dim, E experts, K top-k, R routed rows,
N rows of one expert.
"""
from __future__ import annotations

from typing import List

import torch

from . import ops
from .experts import activate, activation_backward


class FusedMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, gate_TK, token_R, pos_TK, rows_per_expert: List[int], activation: str,
                w1_EDH, b1_EH, w2_EHD, b2_ED):
        x_TD = x_TD.contiguous()
        D = x_TD.shape[1]
        scratch_ND = x_TD.new_empty(max(rows_per_expert, default=0), D)

        pre_RH = ops.new_empty(x_TD, token_R.shape[0], w1_EDH.shape[2])
        for e, (token_N, pre_NH) in enumerate(zip(token_R.split(rows_per_expert), pre_RH.split(rows_per_expert))):
            if token_N.shape[0]:
                x_ND = torch.index_select(x_TD, 0, token_N, out=scratch_ND[:token_N.shape[0]])
                torch.mm(x_ND, w1_EDH[e], out=pre_NH)
                if b1_EH is not None:
                    pre_NH.add_(b1_EH[e])
        act_RH, saved_RH = activate(pre_RH, activation)

        expert_y_RD = ops.new_empty(x_TD, token_R.shape[0], D)
        for e, (act_NH, y_ND) in enumerate(zip(act_RH.split(rows_per_expert), expert_y_RD.split(rows_per_expert))):
            if act_NH.shape[0]:
                torch.mm(act_NH, w2_EHD[e], out=y_ND)
                if b2_ED is not None:
                    y_ND.add_(b2_ED[e])
        y_TD = ops.gather_sum(expert_y_RD, pos_TK, gate_TK, None)[0]

        ctx.save_for_backward(x_TD, saved_RH, expert_y_RD, gate_TK, token_R, pos_TK, w1_EDH, w2_EHD)
        ctx.rows_per_expert, ctx.activation = rows_per_expert, activation
        ctx.bias1, ctx.bias2 = b1_EH is not None, b2_ED is not None
        return y_TD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_TD):
        x_TD, saved_RH, expert_y_RD, gate_TK, token_R, pos_TK, w1_EDH, w2_EHD = ctx.saved_tensors
        rows = ctx.rows_per_expert
        scratch_ND = x_TD.new_empty(max(rows, default=0), x_TD.shape[1])
        token_blocks = token_R.split(rows)

        # every routed row's output gradient, scaled by its gate, and the gate gradients <g, expert output>
        grad_RD, grad_gate_TK = ops.scatter_rows(grad_y_TD.contiguous(), pos_TK, gate_TK,
                                                 expert_y_RD if ctx.needs_input_grad[1] else None, token_R.shape[0])
        act_RH, pre_grad = activation_backward(saved_RH, ctx.activation)

        grad_act_RH = ops.new_empty(x_TD, *act_RH.shape)
        grad_w2_EHD = ops.new_empty(w2_EHD, *w2_EHD.shape)
        grad_b2_ED = w2_EHD.new_zeros(w2_EHD.shape[0], w2_EHD.shape[2]) if ctx.bias2 else None
        for e, (act_NH, grad_act_NH, grad_y_ND) in enumerate(zip(act_RH.split(rows), grad_act_RH.split(rows),
                                                                 grad_RD.split(rows))):
            if not act_NH.shape[0]:
                grad_w2_EHD[e].zero_()
                continue
            torch.mm(grad_y_ND, w2_EHD[e].t(), out=grad_act_NH)
            torch.mm(act_NH.t(), grad_y_ND, out=grad_w2_EHD[e])
            if ctx.bias2:
                torch.sum(grad_y_ND, dim=0, out=grad_b2_ED[e])

        grad_pre_RH = pre_grad(grad_act_RH)

        # first projection: weight gradients from re-gathered inputs; the routed rows' input
        # gradients reuse grad_RD and one gather_sum adds them into their tokens
        grad_w1_EDH = ops.new_empty(w1_EDH, *w1_EDH.shape)
        grad_b1_EH = w1_EDH.new_zeros(w1_EDH.shape[0], w1_EDH.shape[2]) if ctx.bias1 else None
        for e, (token_N, grad_pre_NH, grad_x_ND) in enumerate(zip(token_blocks, grad_pre_RH.split(rows),
                                                                  grad_RD.split(rows))):
            if not token_N.shape[0]:
                grad_w1_EDH[e].zero_()
                continue
            x_ND = torch.index_select(x_TD, 0, token_N, out=scratch_ND[:token_N.shape[0]])
            torch.mm(x_ND.t(), grad_pre_NH, out=grad_w1_EDH[e])
            if ctx.bias1:
                torch.sum(grad_pre_NH, dim=0, out=grad_b1_EH[e])
            if ctx.needs_input_grad[0]:
                torch.mm(grad_pre_NH, w1_EDH[e].t(), out=grad_x_ND)
        grad_x_TD = ops.gather_sum(grad_RD, pos_TK, None, None)[0] if ctx.needs_input_grad[0] else None

        grad_gate_TK = grad_gate_TK if ctx.needs_input_grad[1] else None
        return grad_x_TD, grad_gate_TK, None, None, None, None, grad_w1_EDH, grad_b1_EH, grad_w2_EHD, grad_b2_ED


def fused_moe(x_TD, gate_TK, plan, experts) -> torch.Tensor:
    return FusedMoE.apply(x_TD, gate_TK, plan.token_R, plan.pos_TK, plan.rows_per_expert, experts.activation,
                          experts.w1_EDH, experts.b1_EH, experts.w2_EHD, experts.b2_ED)
