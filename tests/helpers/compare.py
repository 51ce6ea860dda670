"""The one relative error the tests compare with: max |actual - expected| / max |expected|, in float64."""
import torch


def relative_error(actual, expected, floor: float = 1e-30) -> float:
    """max |actual - expected| / max |expected| (the scale floored at floor), computed in float64 on detached values.
    None stands for an absent gradient, read as zeros (None against None, or against zeros, is 0); a shape
    mismatch is inf; two empty tensors (a rank without tokens) are 0. Python numbers are read as 0-d tensors."""
    if expected is None:
        return 0.0 if actual is None or not torch.as_tensor(actual).abs().max() else float("inf")
    expected = torch.as_tensor(expected).detach().double()
    actual = torch.zeros_like(expected) if actual is None else torch.as_tensor(actual).detach().double()
    if actual.shape != expected.shape:
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    scale = expected.abs().max().clamp(min=floor)
    return float((actual - expected).abs().max() / scale)


def assert_close_rel(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = relative_error(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"
