"""Memory full of poison for the Triton kernels' buffers: an element a kernel leaves unwritten, or a buffer it reads
before writing, shows in the result."""
import torch


def poisoned_empty(shape, dtype, device):
    """What the kernel modules' _empty returns under poison: NaN for floats, -12345 for integers."""
    return torch.full(shape, float("nan") if dtype.is_floating_point else -12345, dtype=dtype, device=device)


def poison_triton_buffers(monkeypatch) -> None:
    """Every buffer triton_kernels, triton_grouped, triton_route and the one-node layer allocate starts poisoned."""
    from moe_plugin.ops import triton_kernels, triton_route
    monkeypatch.setattr(triton_kernels, "_empty", poisoned_empty)
    monkeypatch.setattr(triton_route, "_empty", poisoned_empty)
