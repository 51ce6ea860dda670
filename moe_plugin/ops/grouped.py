"""Grouped GEMM over the routed rows as the custom op moe_plugin::grouped_mm, on torch's
F.grouped_mm, with a fake (meta) implementation so torch.compile traces it in every dtype.

Shape legend: moe_plugin/__init__.py (here R routed rows (grouped by expert), I input dim, O output dim, E groups
(experts)).
offs_E holds each group's end row (int32, cumulative, on the rows' device); rows past offs_E[-1]
belong to no group (the dropped choices of a fixed capacity sit there).

On CPU with the native kernels (csrc/), the op runs torch's own CPU grouped-mm kernel (the function
F.grouped_mm calls there) into pooled memory; elsewhere F.grouped_mm itself.

torch 2.13's F.grouped_mm has three traps this op hides (all measured):
  - rows past the last offset come back uninitialized: they are zeroed here;
  - it wants every row stride a multiple of 16 bytes: odd widths are zero-padded here;
  - its own fake function accepts bf16 only, so torch.compile of an fp32 call fails: the fake
    below takes any dtype; and it has no fp64 kernel: fp64 runs the per-expert loop (reference),
    as do fp32 and fp16 on CUDA, where torch documents bf16 only (the loop reads the offsets on the host).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .choice import device_kind, direct, eager_triton, kernels_for
from .tail import tail_unread
from .torch_grouped import grouped_mm_loop

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor, bias_EO: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """Two forms:
      a [R, I], b [E, I, O] -> [R, O]: group e's rows times b[e] (+ bias_EO[e]); rows past the last offset 0.
      a [I, R], b [R, O]    -> [E, I, O]: a[:, group e] @ b[group e] (weight gradients); 0 for empty groups.
    The op moe_plugin::grouped_mm, or its kernels called directly where its dispatch adds nothing (ops.direct).
    """
    return (_grouped_mm_kernels if direct(a, b, bias_EO) else _grouped_mm_op)(a, b, offs_E, bias_EO)


def _grouped_mm_kernels(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor, bias_EO: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    if a.dtype in GROUPED_DTYPES and (device_kind(a.device) == "cpu" or a.dtype == torch.bfloat16):
        out = _aligned_grouped_mm(a, b, offs_E)
    else:
        out = grouped_mm_loop(a, b, offs_E)
    if b.dim() == 3:
        if not tail_unread():
            zero_rows_past(out, offs_E[-1])
        if bias_EO is not None:
            add_bias(out, bias_EO, offs_E)
    return out


_grouped_mm_op = torch.library.custom_op("moe_plugin::grouped_mm", _grouped_mm_kernels, mutates_args=())


@_grouped_mm_op.register_fake
def _(a, b, offs_E, bias_EO=None):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs_E.shape[0], a.shape[0], b.shape[1])


def grouped_sum(x_RO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[E, O]: the sum of each group's rows (bias gradients), with no host synchronization: on CUDA in eager
    mode the Triton kernel (per-group sums, no atomics), under compile an index_add over the rows' groups."""
    E = offs_E.shape[0]
    triton_kernels = eager_triton(x_RO.device)
    if triton_kernels is not None:
        return triton_kernels.grouped_sum(x_RO, offs_E)
    if device_kind(x_RO.device) == "cpu" and not torch.compiler.is_compiling():   # CPU eager: block sums, no index
        sums, start = x_RO.new_zeros(E, x_RO.shape[1]), 0
        for e, end in enumerate(offs_E.tolist()):
            if end > start:
                torch.sum(x_RO[start:end], dim=0, out=sums[e])
            start = end
        return sums
    group_R = group_of_rows(offs_E, x_RO.shape[0])
    sums = x_RO.new_zeros(E + 1, x_RO.shape[1]).index_add_(0, group_R, x_RO)
    return sums[:E]


def group_of_rows(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The group of every row, E for rows past the last offset."""
    rows_R = torch.arange(num_rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.bucketize(rows_R, offs_E, right=True)


def offsets(counts_E, device=None) -> torch.Tensor:
    """int32 end offsets from per-group row counts (a list or a tensor)."""
    counts_E = torch.as_tensor(counts_E, device=device)
    return counts_E.cumsum(0).to(torch.int32)


def _aligned_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """F.grouped_mm with the non-grouped widths zero-padded to 16 bytes where needed."""
    align = 16 // a.element_size()
    if b.dim() == 3:
        I, O = a.shape[1], b.shape[2]
        pad_i, pad_o = -I % align, -O % align
        if pad_i:         # a is [R, I]: copied only where its own width needs it
            a = F.pad(a, (0, pad_i))
        if pad_i or pad_o:
            b = F.pad(b, (0, pad_o, 0, pad_i))
        out = _grouped(a.contiguous(), b, offs_E)
        return out[:, :O].contiguous() if pad_o else out
    I, O = a.shape[0], b.shape[1]
    pad_i, pad_o = -I % align, -O % align
    if pad_i or a.stride(0) != 1:       # a column-major [I', R]: the transpose of a row-major [R, I']
        a = F.pad(a.t(), (0, pad_i)).contiguous().t()
    if pad_o or b.stride(1) != 1:
        b = F.pad(b, (0, pad_o)).contiguous()
    out = _grouped(a, b, offs_E)
    return out[:, :I, :O].contiguous() if pad_i or pad_o else out


def _grouped(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """F.grouped_mm; on CPU with the native kernels, the same torch CPU kernel into pooled memory
    (a fresh [R, H] output costs more in page faults than a tenth of the GEMM)."""
    if device_kind(a.device) == "cpu":
        module, name, _ = kernels_for(a.device)
        if name == "native":
            return module.grouped_mm(a, b, offs_E)
    return F.grouped_mm(a, b, offs=offs_E)


def zero_rows_past(out_RO: torch.Tensor, end: torch.Tensor) -> None:
    """out_RO[end:] = 0 for a 0-dim integer tensor end, without a device synchronization."""
    if device_kind(out_RO.device) == "cpu":      # reading a CPU tensor is no device synchronization
        start = int(end)
        if start < out_RO.shape[0]:
            out_RO[start:].zero_()
        return
    triton_kernels = eager_triton(out_RO.device)
    if triton_kernels is not None and out_RO.is_contiguous():   # touches only the rows past end
        triton_kernels.zero_rows_past(out_RO, end)
    else:
        past_R = torch.arange(out_RO.shape[0], device=out_RO.device) >= end
        out_RO.masked_fill_(past_R.unsqueeze(1), 0)


def add_bias(out_RO: torch.Tensor, bias_EO: torch.Tensor, offs_E: torch.Tensor) -> None:
    """out_RO[r] += bias_EO[group of r], in place; rows past the last offset untouched."""
    triton_kernels = eager_triton(out_RO.device)
    if triton_kernels is not None and out_RO.is_contiguous():      # one pass over the rows, one launch
        triton_kernels.add_bias_rows(out_RO, bias_EO, offs_E)
        return
    if device_kind(out_RO.device) != "cpu":    # the reference (torch.compile fuses it)
        bias_RO = F.pad(bias_EO, (0, 0, 0, 1)).index_select(0, group_of_rows(offs_E, out_RO.shape[0]))
        out_RO += bias_RO
        return
    start = 0
    for e, end in enumerate(offs_E.tolist()):    # in place, block by block: no [R, O] temporary
        if end > start:
            out_RO[start:end].add_(bias_EO[e])
        start = end
