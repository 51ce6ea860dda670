"""Where the fused grouped GEMMs (triton_grouped.py) run: on CUDA tensors in eager mode with the Triton kernels
chosen (choice.eager_triton), for inputs they take, and only where they measured faster than what they replace
(F.grouped_mm plus today's separate passes), timed once per shape and dtype and cached. Elsewhere (CPU, a compiled
graph, another activation, LoRA on the projection) the caller runs today's path.

Shape legend: T tokens, D model dim, H hidden width, F the first projection's width, E experts, K top-k, R routed rows.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from . import scatter_rows, swiglu, torch_grouped
from .choice import eager_triton, triton_modules
from .grouped import grouped_mm, grouped_sum

_FASTER: Dict[tuple, bool] = {}     # (kernel, shapes, dtype, options) -> whether the fused kernel won
REPEATS = 5


def gather_up(x_TD: torch.Tensor, pos_TK: torch.Tensor, offs_E: torch.Tensor, activation, w1_EDF: torch.Tensor,
              b1_EF: Optional[torch.Tensor]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(act_RH, saved) of the up projection on x's routed rows (what scatter_rows, grouped_mm and
    activations.activate give) from triton_grouped.gather_up, which reads the rows by index, where it runs and
    measured faster; else None. activation: an activations.Activation (a clamped one is not fused) or a name."""
    name, limit = (activation, None) if isinstance(activation, str) else (activation.name, activation.limit)
    if eager_triton(x_TD.device) is None or limit is not None:
        return None
    triton_grouped = triton_modules()[2]
    if not triton_grouped.supports(x_TD, name):
        return None
    R = pos_TK.numel()

    def fused():
        token_R = torch_grouped.tokens_of_rows(pos_TK, R)
        return triton_grouped.gather_up(x_TD, token_R, offs_E, w1_EDF, b1_EF, name)

    def unfused():
        pre_RF = grouped_mm(scatter_rows(x_TD, pos_TK, None, None, R)[0], w1_EDF, offs_E, b1_EF)
        if name == "relu":
            return pre_RF.relu_()
        if name == "swiglu":
            return swiglu(pre_RF)
        gate_RH, up_RH = pre_RF.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate_RH) * up_RH

    key = ("gather_up", tuple(x_TD.shape), tuple(w1_EDF.shape), R, x_TD.dtype, name, b1_EF is not None)
    return fused() if measured_faster(key, fused, unfused, x_TD.device) else None


class RoutedRows(NamedTuple):
    """x's routed rows as the fused layer's backward knows them: called, the gathered [R, D] rows (scatter_rows);
    weight_grad_gathered reads them from x_TD by index instead."""
    x_TD: torch.Tensor
    pos_TK: torch.Tensor
    num_rows: int

    def __call__(self) -> torch.Tensor:
        return scatter_rows(self.x_TD, self.pos_TK, None, None, self.num_rows)[0]


def weight_grad_gathered(rows: RoutedRows, grad_RF: torch.Tensor, offs_E: torch.Tensor, w1_EDF: torch.Tensor,
                         bias: bool) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """(grad_w1_EDF laid out as w1_EDF is, grad_b1_EF or None) of the first projection from
    triton_grouped.wgrad_gather, which reads x's routed rows by index (no [R, D] gather) and sums the bias gradient in
    the same pass, where it runs (eager CUDA, x and grad in one of its dtypes) and measured faster than the gather,
    experts.weight_grad and ops.grouped_sum; else None."""
    x_TD, pos_TK, R = rows
    if eager_triton(x_TD.device) is None:
        return None
    triton_grouped = triton_modules()[2]
    if grad_RF.dtype not in triton_grouped.DTYPES or x_TD.dtype != grad_RF.dtype:
        return None
    transposed = w1_EDF.stride(1) == 1 and w1_EDF.stride(2) != 1

    def fused():
        return triton_grouped.wgrad_gather(x_TD, torch_grouped.tokens_of_rows(pos_TK, R), offs_E, grad_RF, w1_EDF,
                                           bias)

    def unfused():     # experts.weight_grad on the gathered rows
        grad_w1_EDF = grouped_mm(grad_RF.t(), rows(), offs_E).transpose(1, 2) if transposed else \
            grouped_mm(rows().t(), grad_RF, offs_E)
        return grad_w1_EDF, grouped_sum(grad_RF, offs_E) if bias else None

    key = ("wgrad_gather", tuple(x_TD.shape), tuple(w1_EDF.shape), R, x_TD.dtype, bias, transposed)
    return fused() if measured_faster(key, fused, unfused, x_TD.device) else None


def measured_faster(key: tuple, fused: Callable[[], object], unfused: Callable[[], object],
                    device: torch.device) -> bool:
    """Whether fused() ran faster than unfused() (medians of REPEATS runs after a warm-up run of each), measured at
    the first call of each key and cached: a training run's shapes repeat, so only its first step pays (and
    synchronizes)."""
    if key not in _FASTER:
        _FASTER[key] = seconds(fused, device) < seconds(unfused, device)
    return _FASTER[key]


def seconds(run: Callable[[], object], device: torch.device) -> float:
    """Median seconds of run() on device: CUDA events on the current stream, or the host clock (the interpreter)."""
    run()
    times = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            run()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def activation_backward_scaled(saved_RH: torch.Tensor, grad_act_RH: torch.Tensor, activation, gate_R1: torch.Tensor,
                               scale_act: bool = False) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(act_RH (gate_R1 * act_RH with scale_act), gate_R1 * grad of the pre-activation, dot_R = <grad_act_RH[r],
    act_RH[r]> in fp32): SwiGLU's backward (clamped or gpt-oss's too) with the gate scale and the gate gradient's row
    sums in one Triton kernel, on eager CUDA; None elsewhere (the caller composes activation_backward, ops.row_dot
    and a scale)."""
    name, limit, alpha = (activation, None, None) if isinstance(activation, str) else activation
    kernels = eager_triton(saved_RH.device)
    if kernels is None or name not in ("swiglu", "swiglu_oai") or saved_RH.dtype == torch.float64:
        return None
    clamp = None if limit is None else (limit, 1.0, 0.0) if name == "swiglu" else (limit, alpha, 1.0)
    grad_pre_RH2, act_RH, dot_R = kernels.swiglu_backward_scaled(grad_act_RH, saved_RH, gate_R1, clamp, scale_act)
    return act_RH, grad_pre_RH2, dot_R


def bias_dot_and_scale(grad_y_RD: torch.Tensor, b2_ED: torch.Tensor, offs_E: torch.Tensor, gate_R1: torch.Tensor,
                       dot_R: torch.Tensor) -> bool:
    """dot_R[r] += <grad_y_RD[r], b2_ED[e]> for each row r of expert e, then grad_y_RD *= gate_R1, in place, in one
    Triton kernel (one pass over the rows, no [R, 1] grouped GEMM) on eager CUDA: True; False elsewhere (the caller
    composes a grouped GEMM, an add and a scale)."""
    kernels = eager_triton(grad_y_RD.device)
    if kernels is None or not grad_y_RD.is_contiguous():
        return False
    kernels.bias_dot_and_scale_(grad_y_RD, b2_ED, offs_E, gate_R1, dot_R)
    return True


def dgrad_activation(grad_y_RD: torch.Tensor, offs_E: torch.Tensor, w2_EHD: torch.Tensor, saved_RH: torch.Tensor,
                     activation, gate_R1: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(act_RH, gate_R1 * grad of the pre-activation, dot_R): the down projection's dgrad and SwiGLU's backward in one
    kernel (triton_grouped.dgrad_swiglu) where it runs (eager CUDA, plain SwiGLU) and measured faster than grouped_mm
    plus activation_backward_scaled; else None."""
    name, limit = (activation, None) if isinstance(activation, str) else (activation.name, activation.limit)
    if eager_triton(saved_RH.device) is None or name != "swiglu" or limit is not None:
        return None
    triton_grouped = triton_modules()[2]
    if grad_y_RD.dtype not in triton_grouped.DTYPES:
        return None

    def fused():
        grad_pre_RH2, act_RH, dot_R = triton_grouped.dgrad_swiglu(grad_y_RD, offs_E, w2_EHD, saved_RH, gate_R1)
        return act_RH, grad_pre_RH2, dot_R

    def unfused():
        grad_act_RH = grouped_mm(grad_y_RD, w2_EHD.transpose(1, 2), offs_E)
        return activation_backward_scaled(saved_RH, grad_act_RH, activation, gate_R1)

    key = ("dgrad_swiglu", tuple(grad_y_RD.shape), tuple(w2_EHD.shape), grad_y_RD.dtype)
    return fused() if measured_faster(key, fused, unfused, grad_y_RD.device) else None
