"""The routing kernels as torch custom ops (moe_plugin::route_slots, ::scatter_rows, ::gather_sum),
with autograd and fake (meta) implementations so torch.compile can trace through them; the expert
GEMMs as moe_plugin::grouped_mm (grouped.py); SwiGLU forward and backward in one pass each
(moe_plugin::swiglu, ::swiglu_backward), and its clamped form (moe_plugin::clamped_swiglu, ::clamped_swiglu_backward:
SwiGLU clamped at a limit, gpt-oss's variant), taken where the native or Triton kernels run (fused_swiglu).

Each op runs on one of three kernel sets, chosen per device (choice.py):
  native   the C++ CPU kernels in csrc/ (built on first use, then cached)
  triton   the Triton kernels, for CUDA tensors
  torch    moe_plugin/ops/torch_ops.py, the reference: always there
MOE_PLUGIN_KERNELS=auto (default) | native | torch picks: auto takes the fastest kernel set that
loads and says once, as a warning, why it fell back; native fails loudly when it cannot load.
"""
from __future__ import annotations

import re
from types import ModuleType
from typing import Optional, Tuple

import torch

# The oldest torch this code runs on (setup.py's install_requires says the same; a test checks): torch 2.11 is
# the GPU machine's (CUDA 13), and the whole test suite passes on 2.11.0 as on 2.13.0. Below it: F.grouped_mm
# is public from 2.10, CPU torch._grouped_mm from 2.9, torch.library.custom_op from 2.4; none of 2.9 and 2.10
# was ever run here.
TORCH_MINIMUM = "2.11"


def require_torch(version: str = torch.__version__) -> None:
    """ImportError unless version (major.minor, any local or pre-release tag) is at least TORCH_MINIMUM."""
    have = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    if have < tuple(int(n) for n in TORCH_MINIMUM.split(".")):
        raise ImportError(f"moe_plugin needs torch>={TORCH_MINIMUM} (grouped GEMMs, custom ops); "
                          f"torch {version} is installed")


require_torch()

from . import torch_ops  # noqa: E402
from .choice import (ENV, MODES, describe, device_kind, direct, eager_triton, kernels_for, mode,  # noqa: F401,E402
                     resolved, simulated_cuda)
from .grouped import grouped_mm, grouped_sum, offsets, zero_rows_past  # noqa: F401,E402
from .torch_grouped import grouped_mm_loop  # noqa: F401,E402
from .tail import tail_rows_unread, tail_unread  # noqa: F401,E402
from . import choice as _choice, tail as _tail  # noqa: E402


def fused_call(*tensors: Optional[torch.Tensor]) -> "_FusedCall":
    """Inside one forward or backward of the fused layer: the rows past the kept ones stay unzeroed
    (tail_rows_unread), the kernel set is looked up once and the direct-call test answered once, for its inputs
    (tensors: the first one's device)."""
    return _FusedCall(tensors[0].device, direct(*tensors))


class _FusedCall:
    """tail_rows_unread() and resolved(device, direct_calls) in one plain context manager (two generator-based
    ones cost the fused layer's every forward and backward a dozen Python calls)."""
    __slots__ = ("device", "direct_calls", "before")

    def __init__(self, device: torch.device, direct_calls: bool):
        self.device, self.direct_calls = device, direct_calls

    def __enter__(self) -> None:
        choice_now = (self.device.type, kernels_for(self.device))   # may raise: before any state is set
        self.before = (tail_unread(), getattr(_choice._CALL, "choice", None), getattr(_choice._CALL, "direct", None))
        _tail._TAIL.unread = True
        _choice._CALL.choice, _choice._CALL.direct = choice_now, self.direct_calls

    def __exit__(self, *exc) -> None:
        _tail._TAIL.unread, _choice._CALL.choice, _choice._CALL.direct = self.before


def new_empty(like: torch.Tensor, *shape: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An uninitialized tensor of like's device and dtype (or dtype); on CPU with the native kernels, large
    ones come from their block pool (reused across steps instead of page-faulted in afresh)."""
    dtype = like.dtype if dtype is None else dtype
    if torch.compiler.is_compiling():      # inside a compiled graph the compiler owns the memory
        return like.new_empty(shape, dtype=dtype)
    module, name, _ = kernels_for(like.device)
    if name == "native":
        return module.empty(list(shape), dtype)
    return like.new_empty(shape, dtype=dtype)


def ones_column(like: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 1] of ones in like's dtype and device. In eager mode a view of one cached column (its fill runs once,
    not in every backward that scatters or gathers a value per choice); fresh where a compiler or a CUDA-graph
    capture owns the memory, or like is not a plain tensor (fake tensors, functorch's transforms)."""
    if type(like) is not torch.Tensor or torch.compiler.is_compiling() or \
            torch._C._functorch.peek_interpreter_stack() is not None or \
            (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return like.new_ones(rows, 1)
    key = (like.device, like.dtype)
    column = _ONES.get(key)
    if column is None or column.shape[0] < rows:
        with torch.inference_mode(False):     # a normal tensor even if made under inference_mode
            column = _ONES[key] = like.new_ones(max(rows, 2 * (0 if column is None else column.shape[0])), 1)
    return column[:rows]


_ONES: dict = {}


def row_dot(a_RH: torch.Tensor, b_RH: torch.Tensor) -> torch.Tensor:
    """[R]: <a_RH[r], b_RH[r]>, accumulated and returned in fp32 (fp64 for fp64 rows): on CPU in eager mode in
    cache-sized chunks, elsewhere one vecdot (a compiled graph fuses its casts)."""
    dtype = torch.promote_types(a_RH.dtype, torch.float32)
    if device_kind(a_RH.device) == "cpu" and not torch.compiler.is_compiling():
        return torch_ops.row_dot(a_RH, b_RH, dtype)
    return torch.linalg.vecdot(a_RH.to(dtype), b_RH.to(dtype))


# ---- custom ops -------------------------------------------------------------------------------

def route_slots(expert_TK: torch.Tensor, order_T: Optional[torch.Tensor], row_start_E: torch.Tensor,
                capacity: int, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """pos_TK [T, K] (routed row of each choice, -1 dropped) and token_R [num_rows]: see torch_ops."""
    run = _route_slots_kernels if direct(expert_TK, order_T, row_start_E) else _route_slots_op
    return run(expert_TK, order_T, row_start_E, capacity, num_rows)


def scatter_rows(src_TD: torch.Tensor, pos_TK: torch.Tensor, scale_TK: Optional[torch.Tensor],
                 other_RD: Optional[torch.Tensor], num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """out_RD[pos[t, k]] = scale[t, k] * src_TD[t]; dot_TK = <src_TD[t], other_RD[pos[t, k]]>: see torch_ops.
    Rows no choice names (past the kept ones) are zero."""
    run = _scatter_rows_kernels if direct(src_TD, scale_TK, other_RD) else _scatter_rows_op
    return run(src_TD, pos_TK, scale_TK, other_RD, num_rows)


def gather_sum(src_RD: torch.Tensor, pos_TK: torch.Tensor, scale_TK: Optional[torch.Tensor],
               other_TD: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """out_TD[t] = sum_k scale[t, k] * src_RD[pos[t, k]]; dot_TK = <other_TD[t], src_RD[pos[t, k]]>: see torch_ops."""
    run = _gather_sum_kernels if direct(src_RD, scale_TK, other_TD) else _gather_sum_op
    return run(src_RD, pos_TK, scale_TK, other_TD)


def _route_slots_kernels(expert_TK: torch.Tensor, order_T: Optional[torch.Tensor], row_start_E: torch.Tensor,
                         capacity: int, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    kernels = kernels_for(expert_TK.device)[0]
    return kernels.route_slots(expert_TK, order_T, row_start_E, capacity, num_rows)


def _scatter_rows_kernels(src_TD: torch.Tensor, pos_TK: torch.Tensor, scale_TK: Optional[torch.Tensor],
                          other_RD: Optional[torch.Tensor], num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    kernels = kernels_for(src_TD.device)[0]
    out_RD, dot_TK = kernels.scatter_rows(src_TD, pos_TK, scale_TK, other_RD, num_rows)
    if num_rows and not tail_unread():
        zero_rows_past(out_RD, (pos_TK >= 0).sum())    # the kept rows come first; the rest hold no choice
    return out_RD, dot_TK


def _gather_sum_kernels(src_RD: torch.Tensor, pos_TK: torch.Tensor, scale_TK: Optional[torch.Tensor],
                        other_TD: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    kernels = kernels_for(src_RD.device)[0]
    return kernels.gather_sum(src_RD, pos_TK, scale_TK, other_TD)


_route_slots_op = torch.library.custom_op("moe_plugin::route_slots", _route_slots_kernels, mutates_args=())
_scatter_rows_op = torch.library.custom_op("moe_plugin::scatter_rows", _scatter_rows_kernels, mutates_args=())
_gather_sum_op = torch.library.custom_op("moe_plugin::gather_sum", _gather_sum_kernels, mutates_args=())


@_route_slots_op.register_fake
def _(expert_TK, order_T, row_start_E, capacity, num_rows):
    return expert_TK.new_empty(expert_TK.shape, dtype=torch.long), expert_TK.new_empty(num_rows, dtype=torch.long)


@_scatter_rows_op.register_fake
def _(src_TD, pos_TK, scale_TK, other_RD, num_rows):
    dot_shape = pos_TK.shape if other_RD is not None else (0,)
    return src_TD.new_empty(num_rows, src_TD.shape[1]), src_TD.new_empty(dot_shape)


@_gather_sum_op.register_fake
def _(src_RD, pos_TK, scale_TK, other_TD):
    dot_shape = pos_TK.shape if other_TD is not None else (0,)
    return src_RD.new_empty(pos_TK.shape[0], src_RD.shape[1]), src_RD.new_empty(dot_shape)


def fused_swiglu(device: torch.device) -> bool:
    """Whether SwiGLU on device runs the one-pass kernels: the native ones on CPU, Triton's on CUDA in eager
    mode (a compiled CUDA graph keeps the composite torch form, which the compiler fuses itself). Compiled
    CPU graphs always take the op: it picks its kernels when it runs."""
    if device_kind(device) == "cuda":
        return eager_triton(device) is not None
    if device_kind(device) != "cpu":
        return False
    return torch.compiler.is_compiling() or kernels_for(device)[1] == "native"


def swiglu(pre_RH2: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up] [R, 2H] -> [R, H]: the one-pass op where fused_swiglu, else
    torch_ops.swiglu_forward."""
    return _one_pass("swiglu_forward", _swiglu_op, pre_RH2, pre_RH2)


def swiglu_backward(grad_RH: torch.Tensor, pre_RH2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad of pre [R, 2H], the activations [R, H]): the one-pass op where fused_swiglu, else
    torch_ops.swiglu_backward."""
    return _one_pass("swiglu_backward", _swiglu_backward_op, pre_RH2, grad_RH, pre_RH2)


def _one_pass(kernel: str, op, pre_RH2: torch.Tensor, *args):
    """The SwiGLU kernel named kernel on args: torch_ops' composite form unless fused_swiglu; else the one-pass
    kernels, called directly where ops.direct allows and through op otherwise."""
    if not fused_swiglu(pre_RH2.device):
        return getattr(torch_ops, kernel)(*args)
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    return (getattr(_swiglu_kernels(pre_RH2.device), kernel) if direct(*tensors) else op)(*args)


def _swiglu_kernels(device: torch.device) -> ModuleType:
    module, name, _ = kernels_for(device)
    return module if name in ("native", "triton") else torch_ops


@torch.library.custom_op("moe_plugin::swiglu", mutates_args=())
def _swiglu_op(pre_RH2: torch.Tensor) -> torch.Tensor:
    return _swiglu_kernels(pre_RH2.device).swiglu_forward(pre_RH2)


@_swiglu_op.register_fake
def _(pre_RH2):
    return pre_RH2.new_empty(pre_RH2.shape[0], pre_RH2.shape[1] // 2)


@torch.library.custom_op("moe_plugin::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad_RH: torch.Tensor, pre_RH2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_kernels(pre_RH2.device).swiglu_backward(grad_RH, pre_RH2)


@_swiglu_backward_op.register_fake
def _(grad_RH, pre_RH2):
    return pre_RH2.new_empty(pre_RH2.shape), grad_RH.new_empty(grad_RH.shape)


def clamped_swiglu(pre_RH2: torch.Tensor, limit: float, alpha: float, beta: float) -> torch.Tensor:
    """(clamp(up, -L, L) + beta) * g * sigmoid(alpha g), g = min(gate, L), of rows [gate | up] [R, 2H] -> [R, H]:
    the one-pass op where fused_swiglu, else torch_ops.clamped_swiglu_forward."""
    return _one_pass("clamped_swiglu_forward", _clamped_swiglu_op, pre_RH2, pre_RH2, limit, alpha, beta)


def clamped_swiglu_backward(grad_RH: torch.Tensor, pre_RH2: torch.Tensor, limit: float, alpha: float, beta: float
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad of pre [R, 2H], the activations [R, H]) of clamped_swiglu."""
    return _one_pass("clamped_swiglu_backward", _clamped_swiglu_backward_op, pre_RH2, grad_RH, pre_RH2, limit, alpha,
                     beta)


@torch.library.custom_op("moe_plugin::clamped_swiglu", mutates_args=())
def _clamped_swiglu_op(pre_RH2: torch.Tensor, limit: float, alpha: float, beta: float) -> torch.Tensor:
    return _swiglu_kernels(pre_RH2.device).clamped_swiglu_forward(pre_RH2, limit, alpha, beta)


@_clamped_swiglu_op.register_fake
def _(pre_RH2, limit, alpha, beta):
    return pre_RH2.new_empty(pre_RH2.shape[0], pre_RH2.shape[1] // 2)


@torch.library.custom_op("moe_plugin::clamped_swiglu_backward", mutates_args=())
def _clamped_swiglu_backward_op(grad_RH: torch.Tensor, pre_RH2: torch.Tensor, limit: float, alpha: float,
                                beta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_kernels(pre_RH2.device).clamped_swiglu_backward(grad_RH, pre_RH2, limit, alpha, beta)


@_clamped_swiglu_backward_op.register_fake
def _(grad_RH, pre_RH2, limit, alpha, beta):
    return pre_RH2.new_empty(pre_RH2.shape), grad_RH.new_empty(grad_RH.shape)


# The dot outputs feed gate gradients inside backward passes; they are not differentiated themselves.

def _scatter_setup(ctx, inputs, output):
    src_TD, pos_TK, scale_TK, other_RD, num_rows = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(src_TD if ctx.needs_input_grad[2] else None, pos_TK, scale_TK)


def _scatter_backward(ctx, grad_RD, _grad_dot):
    src_TD, pos_TK, scale_TK = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:     # only the scale asks: its dot products, no row gradient
        return None, None, _choice_dot(grad_RD, pos_TK, src_TD) if src_TD is not None else None, None, None
    grad_TD, grad_scale_TK = gather_sum(grad_RD.contiguous(), pos_TK, scale_TK, src_TD)
    return grad_TD, None, grad_scale_TK if src_TD is not None else None, None, None


def _gather_setup(ctx, inputs, output):
    src_RD, pos_TK, scale_TK, other_TD = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.num_rows = src_RD.shape[0]
    ctx.save_for_backward(src_RD if ctx.needs_input_grad[2] else None, pos_TK, scale_TK)


def _gather_backward(ctx, grad_TD, _grad_dot):
    src_RD, pos_TK, scale_TK = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, _choice_dot(src_RD, pos_TK, grad_TD) if src_RD is not None else None, None
    grad_RD, grad_scale_TK = scatter_rows(grad_TD.contiguous(), pos_TK, scale_TK, src_RD, ctx.num_rows)
    return grad_RD, None, grad_scale_TK if src_RD is not None else None, None


def _choice_dot(rows_RD: torch.Tensor, pos_TK: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
    """dot_TK[t, k] = <x_TD[t], rows_RD[pos_TK[t, k]]>, 0 for dropped choices (gather_sum's dot, without its sum)."""
    if rows_RD.shape[0] == 0:
        return x_TD.new_zeros(pos_TK.shape)
    rows_TKD = rows_RD.index_select(0, pos_TK.clamp(min=0).reshape(-1)).view(*pos_TK.shape, rows_RD.shape[1])
    dot_TK = torch.bmm(rows_TKD, x_TD.unsqueeze(-1)).squeeze(-1)
    return dot_TK.masked_fill(pos_TK < 0, 0)


_scatter_rows_op.register_autograd(_scatter_backward, setup_context=_scatter_setup)
_gather_sum_op.register_autograd(_gather_backward, setup_context=_gather_setup)
