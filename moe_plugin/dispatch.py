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

from . import ops


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
    """Give every (token, choice) a slot in its expert: the count of earlier choices of that expert.

    Choices are ordered choice-major (every token's first choice before any second choice), and
    within a choice by token order, or by descending priority_T (batch-prioritized routing).
    """
    T, K = expert_TK.shape
    order_T = None if priority_T is None else torch.sort(priority_T, descending=True, stable=True).indices
    load_E = torch.bincount(expert_TK.reshape(-1), minlength=num_experts)
    max_load = int(load_E.max()) if T > 0 else 0
    capacity = capacity_for(capacity_factor, max_load, T, num_experts, K, min_capacity)
    kept_E = load_E.clamp(max=capacity)
    rows_per_expert = kept_E.tolist()
    pos_TK, token_R = ops.route_slots(expert_TK, order_T, kept_E.cumsum(0) - kept_E, capacity, sum(rows_per_expert))
    return Plan(token_R, pos_TK, pos_TK >= 0, load_E, rows_per_expert, capacity)


def encode(x_TD: torch.Tensor, plan: Plan) -> torch.Tensor:
    """x_RD[r] = x_TD[token_R[r]]: each kept choice's token row, grouped by expert."""
    return ops.scatter_rows(x_TD, plan.pos_TK, None, None, plan.num_rows)[0]


def decode(y_RD: torch.Tensor, gate_TK: torch.Tensor, plan: Plan) -> torch.Tensor:
    """y_TD[t] = sum over kept k of gate_TK[t, k] * y_RD[pos_TK[t, k]]."""
    return ops.gather_sum(y_RD, plan.pos_TK, gate_TK, None)[0]
