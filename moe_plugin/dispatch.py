"""Slots, capacity and the index-based encode (tokens -> routed rows) and decode (rows -> tokens).

Legend: T tokens, D model dim, E experts, K top-k, C capacity per expert,
R routed rows: the kept (token, choice) pairs, grouped by expert, in slot order.

The routed rows are the padded [E, C, D] buffer with its empty slots squeezed out: expert e owns
rows [row_start[e], row_start[e] + kept[e]), and slot s of expert e is row row_start[e] + s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class Plan:
    token_R: torch.Tensor       # token of each routed row
    pos_TK: torch.Tensor        # routed row of each (token, choice); -1 where dropped
    kept_TK: torch.Tensor       # bool, pos_TK >= 0
    load_E: torch.Tensor        # choices per expert before dropping
    rows_per_expert: List[int]  # kept rows per expert (host ints: the expert loop slices with them)
    capacity: int

    @property
    def num_rows(self) -> int:
        return int(self.token_R.shape[0])


def fixed_capacity(capacity_factor: float, num_tokens: int, num_experts: int, top_k: int, min_capacity: int) -> int:
    return max(math.ceil(top_k * capacity_factor * num_tokens / num_experts), min_capacity)


def capacity_for(capacity_factor: float, max_load: int, num_tokens: int, num_experts: int,
                 top_k: int, min_capacity: int) -> int:
    """> 0: fixed; == 0: dropless (the largest load); < 0: the largest load capped at |cf| x fixed."""
    if capacity_factor > 0:
        return fixed_capacity(capacity_factor, num_tokens, num_experts, top_k, min_capacity)
    if capacity_factor == 0:
        return max_load
    return min(max_load, fixed_capacity(-capacity_factor, num_tokens, num_experts, top_k, min_capacity))


def plan_routes(expert_TK: torch.Tensor, num_experts: int, capacity_factor: float, min_capacity: int,
                priority_T: Optional[torch.Tensor] = None) -> Plan:
    """Give every (token, choice) a slot in its expert: cumsum-minus-one over the choices in order.

    Choices are ordered choice-major (every token's first choice before any second choice), and
    within a choice by token order, or by descending priority_T (batch-prioritized routing).
    """
    T, K = expert_TK.shape
    device = expert_TK.device
    order_T = torch.arange(T, device=device) if priority_T is None else \
        torch.sort(priority_T, descending=True, stable=True).indices
    expert_A = expert_TK.index_select(0, order_T).t().reshape(-1)           # A = K*T choices in order
    token_A = order_T.repeat(K)
    choice_A = torch.arange(K, device=device).repeat_interleave(T)

    # slot = (cumsum of earlier choices of the same expert) - 1; a stable sort groups the choices by
    # expert in order, so the slot is the position in the sorted list minus the expert's start
    load_E = torch.bincount(expert_A, minlength=num_experts)
    expert_S, sorted_A = torch.sort(expert_A, stable=True)
    start_E = load_E.cumsum(0) - load_E
    slot_S = torch.arange(expert_S.shape[0], device=device) - start_E[expert_S]
    max_load = int(load_E.max()) if T > 0 else 0
    capacity = capacity_for(capacity_factor, max_load, T, num_experts, K, min_capacity)

    kept_E = load_E.clamp(max=capacity)
    rows_per_expert = kept_E.tolist()
    kept_S = slot_S < capacity
    token_R = token_A[sorted_A[kept_S]]                    # sorted order is (expert, slot) order
    row_S = torch.full_like(slot_S, -1)
    row_S[kept_S] = torch.arange(token_R.shape[0], device=device)
    pos_TK = torch.empty(T, K, dtype=torch.long, device=device)
    pos_TK[token_A[sorted_A], choice_A[sorted_A]] = row_S
    return Plan(token_R, pos_TK, pos_TK >= 0, load_E, rows_per_expert, capacity)


def gather_rows(x_TD: torch.Tensor, token_R: torch.Tensor) -> torch.Tensor:
    return x_TD.index_select(0, token_R)


def choices_to_rows(values_TK: torch.Tensor, pos_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """values_R[pos_TK[t, k]] = values_TK[t, k] for every kept choice."""
    kept_TK = pos_TK >= 0
    values_R = values_TK.new_empty(num_rows)
    values_R[pos_TK[kept_TK]] = values_TK[kept_TK]
    return values_R


def rows_to_choices(values_R: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """values_TK[t, k] = values_R[pos_TK[t, k]] for kept choices, 0 for dropped ones."""
    kept_TK = pos_TK >= 0
    values_TK = values_R.new_zeros(pos_TK.shape)
    values_TK[kept_TK] = values_R[pos_TK[kept_TK]]
    return values_TK


def _chunk_rows(tensor: torch.Tensor) -> int:
    """Rows per chunk so that a [chunk, D] scratch stays in cache (about 512 KiB)."""
    return max(16, (1 << 19) // max(1, tensor.shape[1] * tensor.element_size()))


def combine_rows(y_RD: torch.Tensor, weight_TK: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k weight_TK[t, k] * y_RD[pos_TK[t, k]]; dropped choices carry weight 0."""
    T, K = pos_TK.shape
    if y_RD.shape[0] == 0:
        return y_RD.new_zeros(T, y_RD.shape[1])
    safe_pos_TK = pos_TK.clamp(min=0)
    y_TD = y_RD.index_select(0, safe_pos_TK[:, 0]).mul_(weight_TK[:, :1])
    if K == 1:
        return y_TD
    # choices after the first go through a small reused scratch: no second [T, D] buffer
    chunk = _chunk_rows(y_RD)
    scratch_CD = y_RD.new_empty(chunk, y_RD.shape[1])
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        rows_CD = scratch_CD[:end - start]
        for k in range(1, K):
            torch.index_select(y_RD, 0, safe_pos_TK[start:end, k], out=rows_CD)
            y_TD[start:end].addcmul_(rows_CD, weight_TK[start:end, k:k + 1])
    return y_TD


def row_dot(a_RD: torch.Tensor, b_RD: torch.Tensor) -> torch.Tensor:
    """dot_R[r] = <a_RD[r], b_RD[r]>, in cache-sized chunks."""
    dot_R = a_RD.new_empty(a_RD.shape[0])
    chunk = _chunk_rows(a_RD)
    scratch_CD = a_RD.new_empty(min(chunk, a_RD.shape[0]), a_RD.shape[1])
    for start in range(0, a_RD.shape[0], chunk):
        end = min(start + chunk, a_RD.shape[0])
        product_CD = torch.mul(a_RD[start:end], b_RD[start:end], out=scratch_CD[:end - start])
        torch.sum(product_CD, dim=1, out=dot_R[start:end])
    return dot_R


class Encode(torch.autograd.Function):
    """x_RD = x_TD[token_R]; backward sums each token's rows back."""

    @staticmethod
    def forward(ctx, x_TD, token_R):
        ctx.save_for_backward(token_R)
        ctx.num_tokens = x_TD.shape[0]
        return gather_rows(x_TD, token_R)

    @staticmethod
    def backward(ctx, grad_RD):
        token_R, = ctx.saved_tensors
        grad_TD = grad_RD.new_zeros(ctx.num_tokens, grad_RD.shape[1])
        return grad_TD.index_add_(0, token_R, grad_RD), None


class Decode(torch.autograd.Function):
    """y_TD = sum_k gate_TK * y_RD[pos_TK]; backward gives the rows and the gates their gradients."""

    @staticmethod
    def forward(ctx, y_RD, gate_TK, token_R, pos_TK):
        gate_TK = gate_TK * (pos_TK >= 0).to(gate_TK.dtype)
        ctx.save_for_backward(y_RD, gate_TK, token_R, pos_TK)
        return combine_rows(y_RD, gate_TK, pos_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_RD, gate_TK, token_R, pos_TK = ctx.saved_tensors
        grad_rows_RD = gather_rows(grad_TD.contiguous(), token_R)
        grad_gate_TK = grad_y_RD = None
        if ctx.needs_input_grad[1]:
            grad_gate_TK = rows_to_choices(row_dot(grad_rows_RD, y_RD), pos_TK)
        if ctx.needs_input_grad[0]:
            gate_R = choices_to_rows(gate_TK, pos_TK, token_R.shape[0])
            grad_y_RD = grad_rows_RD.mul_(gate_R[:, None])
        return grad_y_RD, grad_gate_TK, None, None


def encode(x_TD: torch.Tensor, plan: Plan) -> torch.Tensor:
    return Encode.apply(x_TD, plan.token_R)


def decode(y_RD: torch.Tensor, gate_TK: torch.Tensor, plan: Plan) -> torch.Tensor:
    return Decode.apply(y_RD, gate_TK, plan.token_R, plan.pos_TK)
