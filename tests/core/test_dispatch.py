import math

import pytest
import torch

from moe_plugin.dispatch import Plan, decode, encode, fixed_capacity, plan_routes


def capacity_for(capacity_factor: float, max_load: int, num_tokens: int, num_experts: int,
                 top_k: int, min_capacity: int) -> int:
    """MoEConfig's capacity rule, written out: > 0 fixed; == 0 dropless (the largest load); < 0 the largest load
    capped at |cf| x fixed."""
    if capacity_factor > 0:
        return fixed_capacity(capacity_factor, num_tokens, num_experts, top_k, min_capacity)
    if capacity_factor == 0:
        return max_load
    return min(max_load, fixed_capacity(-capacity_factor, num_tokens, num_experts, top_k, min_capacity))


def slots_by_counting(expert_TK, priority_T=None):
    """Plain loop: visit choices choice-major in token (or priority) order; slot = earlier visits."""
    T, K = expert_TK.shape
    order = list(range(T)) if priority_T is None else \
        sorted(range(T), key=lambda t: -float(priority_T[t]))   # sorted() is stable
    seen, slot = {}, {}
    for k in range(K):
        for t in order:
            e = int(expert_TK[t, k])
            slot[t, k] = seen.get(e, 0)
            seen[e] = slot[t, k] + 1
    return slot


@pytest.mark.parametrize("T, E, K, cf", [(1, 1, 1, 1.0), (37, 4, 2, 0.5), (101, 16, 4, 1.25),
                                         (64, 8, 8, 0.0), (50, 5, 3, -0.4), (0, 4, 2, 1.0)])
@pytest.mark.parametrize("prioritized", [False, True])
def test_plan_matches_counting_loop(T, E, K, cf, prioritized):
    expert_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    priority_T = torch.randn(T) if prioritized else None
    plan = plan_routes(expert_TK, E, cf, min_capacity=2, priority_T=priority_T)
    slot = slots_by_counting(expert_TK, priority_T)
    load = [sum(int(e) == i for e in expert_TK.reshape(-1)) for i in range(E)]
    assert plan.load_E.tolist() == load
    assert plan.capacity == capacity_for(cf, max(load, default=0), T, E, K, 2)
    kept_rows = [min(n, plan.capacity) for n in load]
    assert plan.kept_E.tolist() == kept_rows and plan.num_rows == T * K   # static: T*K rows
    start = [sum(kept_rows[:e]) for e in range(E)]
    assert plan.offs_E.dtype == torch.int32 and plan.offs_E.tolist() == [start[e] + kept_rows[e] for e in range(E)]
    for (t, k), s in slot.items():
        e = int(expert_TK[t, k])
        expected = start[e] + s if s < plan.capacity else -1
        assert int(plan.pos_TK[t, k]) == expected
    assert torch.equal(plan.kept_TK, plan.pos_TK >= 0)


def test_capacity_policies():
    # fixed: ceil(k * cf * T / E), at least min_capacity
    assert capacity_for(1.25, max_load=99, num_tokens=4096, num_experts=8, top_k=2, min_capacity=4) == 1280
    assert capacity_for(0.01, 99, 10, 8, 1, min_capacity=4) == 4
    assert capacity_for(0.3, 99, 10, 3, 1, min_capacity=0) == math.ceil(0.3 * 10 / 3)
    # dropless: the real largest load
    assert capacity_for(0.0, 77, 4096, 8, 2, 4) == 77
    # adaptive: the largest load, capped at |cf| x the fixed capacity
    assert capacity_for(-2.0, 77, 64, 8, 2, 0) == 32
    assert capacity_for(-2.0, 20, 64, 8, 2, 0) == 20


def _plan(T=23, E=5, K=2, cf=0.6):
    expert_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return plan_routes(expert_TK, E, cf, 0)


def test_encode_decode_gradcheck():
    plan = _plan()
    assert not plan.kept_TK.all(), "the plan should drop some choices"
    x_TD = torch.randn(23, 6, dtype=torch.float64, requires_grad=True)
    y_RD = torch.randn(plan.num_rows, 6, dtype=torch.float64, requires_grad=True)
    gate_TK = torch.rand(23, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: encode(x, plan), (x_TD,))
    assert torch.autograd.gradcheck(lambda y, g: decode(y, g, plan), (y_RD, gate_TK))


def test_encode_decode_against_loops():
    plan = _plan(T=31, E=4, K=3, cf=0.7)
    x_TD, gate_TK = torch.randn(31, 5), torch.rand(31, 3)
    x_RD = encode(x_TD, plan)
    kept = int(plan.kept_TK.sum())
    assert x_RD.shape == (31 * 3, 5) and not x_RD[kept:].any(), "rows past the kept ones are zero"
    for t in range(31):
        for k in range(3):
            row = int(plan.pos_TK[t, k])
            if row >= 0:
                assert torch.equal(x_RD[row], x_TD[t])
    y_TD = decode(x_RD * 2, gate_TK, plan)
    expected = torch.stack([sum(2 * gate_TK[t, k] * x_TD[t] for k in range(3) if plan.pos_TK[t, k] >= 0)
                            + torch.zeros(5) for t in range(31)])
    assert torch.allclose(y_TD, expected, atol=1e-6)


def test_all_dropped_and_empty():
    plan = Plan(torch.full((4, 2), -1), torch.zeros(4, 2, dtype=torch.bool), torch.tensor([4, 4]),
                torch.tensor([0, 0]), torch.tensor([0, 0], dtype=torch.int32), 0, 0.5, 0)
    x_TD = torch.randn(4, 3, requires_grad=True)
    gate_TK = torch.rand(4, 2, requires_grad=True)
    y_TD = decode(encode(x_TD, plan), gate_TK, plan)
    assert torch.equal(y_TD, torch.zeros(4, 3))
    y_TD.sum().backward()
    assert torch.equal(x_TD.grad, torch.zeros(4, 3)) and torch.equal(gate_TK.grad, torch.zeros(4, 2))
