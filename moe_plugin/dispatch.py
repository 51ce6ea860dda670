"""Slots, capacity and the index-based encode (tokens -> routed rows) and decode (rows -> tokens).

Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, E experts, K top-k, C capacity per expert).
R routed rows: T*K of them, the kept (token, choice) pairs first, grouped by expert in slot order,
then room for the dropped ones (no choice names those rows; the expert GEMMs give them 0).

Planning reads nothing back to the host, so shapes are static and torch.compile / CUDA graphs can
capture the layer: R is T*K whatever the routes, expert e owns rows [offs_E[e-1], offs_E[e]) with
the offsets on the device, and a choice is kept when its slot is below the cap. The cap is a host
int known from T: the fixed capacity for cf > 0, T for dropless (no expert can get more than T
choices: top-k picks distinct experts), and for cf < 0 the fixed capacity of |cf| too -- capping
at min(largest load, fixed) drops exactly the same choices, as no slot reaches the largest load.
The capacity the padded [E, C, D] layout would use is reported lazily (Plan.capacity).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import ops


@dataclass
class Plan:
    pos_TK: torch.Tensor        # routed row of each (token, choice); -1 where dropped
    kept_TK: torch.Tensor       # bool, pos_TK >= 0
    load_E: torch.Tensor        # choices per expert before dropping
    kept_E: torch.Tensor        # kept rows per expert
    offs_E: torch.Tensor        # int32 end row of each expert's block (cumulative kept_E)
    cap: int                    # the slot limit applied (host int, from T and the config)
    capacity_factor: float
    fixed: int                  # the fixed capacity for |capacity_factor| (cf != 0)

    @property
    def num_rows(self) -> int:
        """Static: T * K."""
        return int(self.pos_TK.numel())

    @property
    def capacity(self) -> int:
        """C of the padded layout: fixed, the largest load (dropless), or the smaller of the two (cf < 0).
        Reads a device tensor unless fixed."""
        if self.capacity_factor > 0:
            return self.fixed
        return padded_capacity(self.capacity_factor, self.fixed, int(self.load_E.max()) if self.pos_TK.shape[0] else 0)


def fixed_capacity(capacity_factor: float, num_tokens: int, num_experts: int, top_k: int, min_capacity: int,
                   formula: str = "ceil", alignment: int = 1) -> int:
    """MoEConfig.capacity_formula: "ceil" max(ceil(k * cf * T / E), min_capacity); "tutel" max(k * int(cf *
    ceil(T / E)), min_capacity), rounded up to a multiple of alignment (Tutel's capacity)."""
    if formula == "ceil":
        return max(math.ceil(top_k * capacity_factor * num_tokens / num_experts), min_capacity)
    capacity = max(top_k * int(capacity_factor * -(-num_tokens // num_experts)), min_capacity)
    return -(-capacity // alignment) * alignment


def padded_capacity(capacity_factor: float, fixed: int, largest_load: int) -> int:
    return fixed if capacity_factor > 0 else largest_load if capacity_factor == 0 else min(largest_load, fixed)


def plan_routes(expert_TK: torch.Tensor, num_experts: int, capacity_factor: float, min_capacity: int,
                priority_T: Optional[torch.Tensor] = None, formula: str = "ceil", alignment: int = 1) -> Plan:
    """Give every (token, choice) a slot in its expert: the count of earlier choices of that expert.

    Choices are ordered choice-major (every token's first choice before any second choice), and
    within a choice by token order, or by descending priority_T (batch-prioritized routing). formula, alignment:
    of the fixed capacity (fixed_capacity).
    """
    T, K = expert_TK.shape
    order_T = None if priority_T is None else torch.sort(priority_T, descending=True, stable=True).indices
    load_E = torch.zeros(num_experts, dtype=torch.long, device=expert_TK.device).scatter_add_(
        0, expert_TK.reshape(-1), torch.ones_like(expert_TK.reshape(-1)))
    fixed = fixed_capacity(abs(capacity_factor), T, num_experts, K, min_capacity, formula, alignment) \
        if capacity_factor else T
    cap = T * K if capacity_factor == 0 else fixed   # dropless: all, even a token naming one expert k times
    kept_E = load_E.clamp(max=cap)
    offs_E = kept_E.cumsum(0)
    pos_TK, _ = ops.route_slots(expert_TK, order_T, offs_E - kept_E, cap, T * K)
    return Plan(pos_TK, pos_TK >= 0, load_E, kept_E, offs_E.to(torch.int32), cap, capacity_factor, fixed)


def gate_inputs(x_TD: torch.Tensor, gate_TK: torch.Tensor, plan: Plan):
    """(x, gate, plan) for gating the experts' inputs: every (token, choice) becomes a token of its own, routed to its
    expert with gate 1 (0 where dropped) and input x_TD[t] * gate_TK[t, k]; choice-major, so the output's K blocks of
    T rows summed are the layer's output. At top-1 the tokens stay as they are."""
    K = gate_TK.shape[1]
    if K == 1:
        return x_TD * gate_TK, plan.kept_TK.to(x_TD.dtype), plan
    pos_N1 = plan.pos_TK.t().reshape(-1, 1)
    x_ND = (gate_TK.t().unsqueeze(-1) * x_TD).reshape(-1, x_TD.shape[1])
    return x_ND, (pos_N1 >= 0).to(x_TD.dtype), dataclasses.replace(plan, pos_TK=pos_N1, kept_TK=pos_N1 >= 0)


def encode(x_TD: torch.Tensor, plan: Plan) -> torch.Tensor:
    """x_RD[r] = x_TD[token of row r]: each kept choice's token row, grouped by expert (T*K rows)."""
    return ops.scatter_rows(x_TD, plan.pos_TK, None, None, plan.num_rows)[0]


def decode(y_RD: torch.Tensor, gate_TK: torch.Tensor, plan: Plan) -> torch.Tensor:
    """y_TD[t] = sum over kept k of gate_TK[t, k] * y_RD[pos_TK[t, k]]."""
    return ops.gather_sum(y_RD, plan.pos_TK, gate_TK, None)[0]
