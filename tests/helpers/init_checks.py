"""Checks that a tensor was drawn as an initializer draws it (not left as uninitialized memory)."""
import math

import torch


def assert_normal(tensor: torch.Tensor, std: float, what: str) -> None:
    """Mean 0 and standard deviation std within 5 standard errors; tails of a normal, not of a uniform."""
    t = tensor.detach().double().reshape(-1)
    n = t.numel()
    assert torch.isfinite(t).all(), f"{what}: not finite"
    assert abs(float(t.mean())) < 5 * std / math.sqrt(n), f"{what}: mean {float(t.mean()):.3g}"
    assert abs(float(t.std()) / std - 1) < 5 / math.sqrt(2 * n), f"{what}: std {float(t.std()):.3g}, expected {std}"
    if n >= 1000:   # the largest of 1000 normal draws exceeds 2.5 std but for odds of 1e-5; a uniform's stays at 1.73
        assert float(t.abs().max()) > 2.5 * std, f"{what}: no normal tails"


def assert_uniform(tensor: torch.Tensor, bound: float, what: str) -> None:
    """Inside +-bound and reaching near it; mean 0 and std bound/sqrt(3) within 5 standard errors."""
    t = tensor.detach().double().reshape(-1)
    n = t.numel()
    assert float(t.abs().max()) <= bound, f"{what}: outside +-{bound}"
    assert abs(float(t.mean())) < 5 * bound / math.sqrt(3 * n), f"{what}: mean {float(t.mean()):.3g}"
    assert abs(float(t.std()) * math.sqrt(3) / bound - 1) < 5 / math.sqrt(n), f"{what}: std {float(t.std()):.3g}"
