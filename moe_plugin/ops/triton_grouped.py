"""Grouped GEMMs with their neighbours fused in, in Triton, for CUDA tensors (issue 34 item 3): the up projection
that reads x's routed rows by index (no gathered copy of x) and applies the bias and the activation in its
epilogue (gather_up); the down projection's dgrad with SwiGLU's backward, the gate scale and the gate gradient in
its epilogue (dgrad_swiglu); the first projection's weight gradient reading x's routed rows by index, with the bias
gradient in the same pass (wgrad_gather). Same results as torch_grouped.py, the reference; on CPU tensors only under
TRITON_INTERPRET=1.

Shape legend: moe_plugin/__init__.py (T tokens, D model dim, H hidden width, F the first projection's width: 2H
gated, [gate | up]; E experts, R routed rows grouped by expert, each expert's block ending at offs_E[e], int32
on the device); RH2 is [R, 2H]. Inside the kernels, M, N and K are a GEMM tile's rows, columns and reduction
dim (BLOCK_M, BLOCK_N, BLOCK_K; _MN a tile), not the layer's letters.
Each program of gather_up and dgrad_swiglu computes one [BLOCK_M, BLOCK_N] tile of one expert's rows; the tiles
are laid out expert after expert, each program reading the layout from offs_E, so the grid is sized from R and E
alone and nothing is read back on the host. Each program of wgrad_gather computes one [BLOCK_M, BLOCK_N] tile of
one expert's [D, F] gradient, its loop running over that expert's rows (none for an empty expert: its tile is 0).
Accumulation in fp32; fp32 inputs multiply in IEEE fp32 (no TF32), as torch's default matmul.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from . import triton_kernels
from .tail import tail_unread
from .triton_kernels import cdiv, next_power_of_2
from .torch_grouped import GATHER_UP_ACTIVATIONS

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_MISSING = "triton is not installed (pip install triton, or pip install moe_plugin[triton])"
_ACTIVATION_CODES = {name: code for code, name in enumerate(GATHER_UP_ACTIVATIONS)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _blocks() -> Tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): tl.dot's smallest tiles under the interpreter (tests run tiny shapes)."""
    if _interpreted():
        return 16, 16, 16
    return 64, 64, 32


def supports(x_TD: torch.Tensor, activation: str) -> bool:
    """Whether gather_up takes these inputs (else the caller runs the unfused path)."""
    return triton is not None and x_TD.dtype in DTYPES and activation in _ACTIVATION_CODES


def gather_up(x_TD: torch.Tensor, token_R: torch.Tensor, offs_E: torch.Tensor, w1_EDF: torch.Tensor,
              b1_EF: Optional[torch.Tensor], activation: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """See torch_grouped.gather_up: (act_RH, saved), rows past the last offset 0."""
    if triton is None:
        raise ImportError(f"moe_plugin.ops.triton_grouped: {_MISSING}")
    if not supports(x_TD, activation):
        raise ValueError(f"gather_up: {x_TD.dtype} / {activation!r} not fused; dtypes {DTYPES}, activations "
                         f"{GATHER_UP_ACTIVATIONS}")
    T, D = x_TD.shape
    E, _, F = w1_EDF.shape
    R = token_R.shape[0]
    gated = activation != "relu"
    H = F // 2 if gated else F
    device, dtype = x_TD.device, x_TD.dtype
    act_RH = triton_kernels._empty((R, H), dtype, device)
    pre_RF = triton_kernels._empty((R, F), dtype, device) if gated else act_RH
    if R == 0 or H == 0:
        return act_RH, pre_RF
    if not tail_unread():     # the rows past the last expert's: 0 (inside the fused layer nothing reads them)
        end = offs_E[-1] if E else torch.zeros((), dtype=torch.int32, device=device)
        for out in {id(act_RH): act_RH, id(pre_RF): pre_RF}.values():
            triton_kernels.zero_rows_past(out, end)
    if E == 0:
        return act_RH, pre_RF
    block_m, block_n, block_k = _blocks()
    grid = (cdiv(R, block_m) + E, cdiv(H, block_n))
    _gather_up_kernel[grid](
        x_TD.contiguous(), token_R.contiguous(), offs_E.contiguous(), w1_EDF,
        b1_EF.contiguous() if b1_EF is not None else w1_EDF, pre_RF, act_RH,
        D, H, F, E, w1_EDF.stride(0), w1_EDF.stride(1), w1_EDF.stride(2),
        HAS_BIAS=b1_EF is not None, ACTIVATION=_ACTIVATION_CODES[activation], IEEE=dtype == torch.float32,
        INTERPRETED=_interpreted(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=next_power_of_2(E))
    return act_RH, pre_RF


def dgrad_swiglu(grad_RD: torch.Tensor, offs_E: torch.Tensor, w2_EHD: torch.Tensor, pre_RH2: torch.Tensor,
                 scale_R1: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See torch_grouped.dgrad_swiglu: the down projection's dgrad with SwiGLU's backward, the gate scale and the
    gate gradient's row sums (atomically added over the hidden tiles, in fp32) in its epilogue."""
    if triton is None:
        raise ImportError(f"moe_plugin.ops.triton_grouped: {_MISSING}")
    R, D = grad_RD.shape
    E, H, _ = w2_EHD.shape
    device, dtype = grad_RD.device, grad_RD.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dgrad_swiglu: {dtype} not fused; dtypes {DTYPES}")
    grad_pre_RH2 = torch.zeros(R, 2 * H, dtype=dtype, device=device)
    act_RH = torch.zeros(R, H, dtype=dtype, device=device)
    dot_R = torch.zeros(R, dtype=torch.float32, device=device)
    if R == 0 or H == 0 or E == 0:
        return grad_pre_RH2, act_RH, dot_R
    block_m, block_n, block_k = _blocks()
    grid = (cdiv(R, block_m) + E, cdiv(H, block_n))
    _dgrad_swiglu_kernel[grid](
        grad_RD.contiguous(), offs_E.contiguous(), w2_EHD, pre_RH2.contiguous(), scale_R1.contiguous(),
        grad_pre_RH2, act_RH, dot_R, D, H, E, w2_EHD.stride(0), w2_EHD.stride(1), w2_EHD.stride(2),
        IEEE=dtype == torch.float32, INTERPRETED=_interpreted(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=next_power_of_2(E))
    return grad_pre_RH2, act_RH, dot_R


def wgrad_gather(x_TD: torch.Tensor, token_R: torch.Tensor, offs_E: torch.Tensor, grad_RF: torch.Tensor,
                 w1_EDF: torch.Tensor, bias: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """See torch_grouped.wgrad_gather: (grad_w1_EDF, grad_b1_EF or None) in grad's dtype, the weight gradient laid out
    in memory as w1_EDF is (experts.weight_grad's rule: a transposed view of [E, F, D] weights gets a transposed
    view too)."""
    if triton is None:
        raise ImportError(f"moe_plugin.ops.triton_grouped: {_MISSING}")
    T, D = x_TD.shape
    E, _, F = w1_EDF.shape
    device, dtype = grad_RF.device, grad_RF.dtype
    if dtype not in DTYPES or x_TD.dtype != dtype:
        raise ValueError(f"wgrad_gather: x {x_TD.dtype} and grad {dtype} not fused; both one of {DTYPES}")
    if w1_EDF.stride(1) == 1 and w1_EDF.stride(2) != 1:
        grad_w_EDF = triton_kernels._empty((E, F, D), dtype, device).transpose(1, 2)
    else:
        grad_w_EDF = triton_kernels._empty((E, D, F), dtype, device)
    grad_b_EF = triton_kernels._empty((E, F), dtype, device) if bias else None
    if E == 0 or F == 0:
        return grad_w_EDF, grad_b_EF
    if T == 0:   # no tokens, so no routed rows: every expert is empty
        grad_w_EDF.zero_()
        return grad_w_EDF, None if grad_b_EF is None else grad_b_EF.zero_()
    args = (x_TD.contiguous(), token_R.contiguous(), offs_E.contiguous(), grad_RF.contiguous(), grad_w_EDF,
            grad_b_EF if bias else grad_w_EDF, D, F, grad_w_EDF.stride(0), grad_w_EDF.stride(1), grad_w_EDF.stride(2))
    flags = dict(HAS_BIAS=bias, IEEE=dtype == torch.float32, INTERPRETED=_interpreted())
    if _interpreted():
        block_m, block_n, block_k = _blocks()
        grid = (max(1, cdiv(D, block_m)) * cdiv(F, block_n), E)     # D = 0: the bias gradient still
        _wgrad_gather_kernel[grid](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    else:
        _wgrad_gather_tuned[lambda meta: (max(1, cdiv(D, meta["BLOCK_M"])) * cdiv(F, meta["BLOCK_N"]),
                                          E)](*args, **flags)
    return grad_w_EDF, grad_b_EF


# wgrad_gather's tiles on the GPU, picked per (D, F, dtype) by Triton's autotuner at the first call (not measured on a
# GPU yet: the candidates are the usual ones for a bf16 GEMM on Hopper)
_WGRAD_CONFIGS = [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4),
                  (128, 128, 64, 8, 3)]


if triton is not None:

    @triton.jit
    def _wgrad_gather_kernel(x_ptr, token_ptr, offs_ptr, grad_ptr, out_ptr, bias_ptr, D, F, stride_oe, stride_od,
                             stride_of, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e = tl.program_id(1)
        tiles_n = tl.cdiv(F, BLOCK_N)
        pid_m = tl.program_id(0) // tiles_n
        d_M = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        f_N = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_M = d_M < D
        mask_N = f_N < F
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(offs_ptr + e)
        acc_MN = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        sum_N = tl.zeros([BLOCK_N], tl.float32)
        for r in range(start, end, BLOCK_K):
            r_K = r + tl.arange(0, BLOCK_K)
            mask_K = r_K < end
            token_K = tl.load(token_ptr + r_K, mask=mask_K, other=0).to(tl.int64)
            x_KM = tl.load(x_ptr + token_K[:, None] * D + d_M[None, :], mask=mask_K[:, None] & mask_M[None, :],
                           other=0)
            g_KN = tl.load(grad_ptr + r_K.to(tl.int64)[:, None] * F + f_N[None, :],
                           mask=mask_K[:, None] & mask_N[None, :], other=0)
            acc_MN = _dot(tl.trans(x_KM), g_KN, acc_MN, IEEE, INTERPRETED)
            if HAS_BIAS:
                sum_N += tl.sum(g_KN.to(tl.float32), 0)
        out_dtype = out_ptr.dtype.element_ty
        out_MN = out_ptr + e.to(tl.int64) * stride_oe + d_M[:, None] * stride_od + f_N[None, :] * stride_of
        tl.store(out_MN, acc_MN.to(out_dtype), mask=mask_M[:, None] & mask_N[None, :])
        if HAS_BIAS:
            if pid_m == 0:
                tl.store(bias_ptr + e.to(tl.int64) * F + f_N, sum_N.to(out_dtype), mask=mask_N)

    _wgrad_gather_tuned = triton.autotune(
        [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k), num_warps=w, num_stages=s)
         for m, n, k, w, s in _WGRAD_CONFIGS], key=["D", "F", "IEEE"])(_wgrad_gather_kernel)

    @triton.jit
    def _expert_tile(offs_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        """(expert, first row of this program's tile, that expert's end row): the tiles laid out expert after
        expert from the offsets; expert E for a spare program past the last tile."""
        pid_m = tl.program_id(0)
        e_E = tl.arange(0, BLOCK_E)
        end_E = tl.load(offs_ptr + e_E, mask=e_E < E, other=0)
        start_E = tl.load(offs_ptr + e_E - 1, mask=(e_E > 0) & (e_E < E), other=0)
        tile_end_E = tl.cumsum((end_E - start_E + BLOCK_M - 1) // BLOCK_M, 0)
        tile_end_E = tl.where(e_E < E, tile_end_E, 2147483647)
        e = tl.sum((tile_end_E <= pid_m).to(tl.int32), 0)
        tile_start = tl.sum(tl.where(e_E == e - 1, tile_end_E, 0), 0)
        row_start = tl.sum(tl.where(e_E == e, start_E, 0), 0) + (pid_m - tile_start) * BLOCK_M
        row_end = tl.sum(tl.where(e_E == e, end_E, 0), 0)
        return e, row_start, row_end

    @triton.jit
    def _dgrad_swiglu_kernel(grad_ptr, offs_ptr, w_ptr, pre_ptr, scale_ptr, grad_pre_ptr, act_ptr, dot_ptr, D, H, E,
                             stride_we, stride_wh, stride_wd, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_E: tl.constexpr):
        e, row_start, row_end = _expert_tile(offs_ptr, E, BLOCK_M, BLOCK_E)
        if e < E:
            r_M = row_start + tl.arange(0, BLOCK_M)
            mask_M = r_M < row_end
            rows_M = r_M.to(tl.int64)
            n_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_N = n_N < H
            w_e = w_ptr + e.to(tl.int64) * stride_we
            acc_MN = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k in range(0, D, BLOCK_K):
                k_K = k + tl.arange(0, BLOCK_K)
                mask_K = k_K < D
                g_MK = tl.load(grad_ptr + rows_M[:, None] * D + k_K[None, :], mask=mask_M[:, None] & mask_K[None, :],
                               other=0)
                w_KN = tl.load(w_e + n_N[None, :] * stride_wh + k_K[:, None] * stride_wd,
                               mask=mask_K[:, None] & mask_N[None, :], other=0)    # W2[e]^T
                acc_MN = _dot(g_MK, w_KN, acc_MN, IEEE, INTERPRETED)
            mask_MN = mask_M[:, None] & mask_N[None, :]
            gate_MN = tl.load(pre_ptr + rows_M[:, None] * 2 * H + n_N[None, :], mask=mask_MN, other=0).to(tl.float32)
            up_MN = tl.load(pre_ptr + rows_M[:, None] * 2 * H + H + n_N[None, :], mask=mask_MN,
                            other=0).to(tl.float32)
            scale_M = tl.load(scale_ptr + rows_M, mask=mask_M, other=0).to(tl.float32)
            sig_MN = 1 / (1 + tl.exp(-gate_MN))
            silu_MN = gate_MN * sig_MN
            act_MN = silu_MN * up_MN
            grad_gate_MN = acc_MN * up_MN * (sig_MN + gate_MN * sig_MN * (1 - sig_MN)) * scale_M[:, None]
            grad_up_MN = acc_MN * silu_MN * scale_M[:, None]
            out_dtype = act_ptr.dtype.element_ty
            tl.store(act_ptr + rows_M[:, None] * H + n_N[None, :], act_MN.to(out_dtype), mask=mask_MN)
            tl.store(grad_pre_ptr + rows_M[:, None] * 2 * H + n_N[None, :], grad_gate_MN.to(out_dtype), mask=mask_MN)
            tl.store(grad_pre_ptr + rows_M[:, None] * 2 * H + H + n_N[None, :], grad_up_MN.to(out_dtype),
                     mask=mask_MN)
            tl.atomic_add(dot_ptr + rows_M, tl.sum(tl.where(mask_MN, acc_MN * act_MN, 0), 1), mask=mask_M)

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
        if INTERPRETED:     # triton 3.9's interpreter multiplies bf16 tiles wrongly (garbage; fp32 is right)
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _gather_up_kernel(x_ptr, token_ptr, offs_ptr, w_ptr, b_ptr, pre_ptr, act_ptr,
                          D, H, F, E, stride_we, stride_wd, stride_wf, HAS_BIAS: tl.constexpr,
                          ACTIVATION: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
        e, row_start, row_end = _expert_tile(offs_ptr, E, BLOCK_M, BLOCK_E)
        if e < E:
            r_M = row_start + tl.arange(0, BLOCK_M)
            mask_M = r_M < row_end
            token_M = tl.load(token_ptr + r_M, mask=mask_M, other=0).to(tl.int64)
            n_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_N = n_N < H
            gated = ACTIVATION != 0
            w_e = w_ptr + e.to(tl.int64) * stride_we
            acc_MN = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up_MN = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k in range(0, D, BLOCK_K):
                k_K = k + tl.arange(0, BLOCK_K)
                mask_K = k_K < D
                x_MK = tl.load(x_ptr + token_M[:, None] * D + k_K[None, :], mask=mask_M[:, None] & mask_K[None, :],
                               other=0)
                w_KN = w_e + k_K[:, None] * stride_wd
                mask_KN = mask_K[:, None] & mask_N[None, :]
                acc_MN = _dot(x_MK, tl.load(w_KN + n_N[None, :] * stride_wf, mask=mask_KN, other=0), acc_MN, IEEE, INTERPRETED)
                if gated:
                    up_MN = _dot(x_MK, tl.load(w_KN + (H + n_N)[None, :] * stride_wf, mask=mask_KN, other=0), up_MN,
                                 IEEE, INTERPRETED)
            if HAS_BIAS:
                acc_MN += tl.load(b_ptr + e * F + n_N, mask=mask_N, other=0).to(tl.float32)[None, :]
                if gated:
                    up_MN += tl.load(b_ptr + e * F + H + n_N, mask=mask_N, other=0).to(tl.float32)[None, :]
            mask_MN = mask_M[:, None] & mask_N[None, :]
            rows_M = r_M.to(tl.int64)
            out_dtype = act_ptr.dtype.element_ty
            if ACTIVATION == 0:     # relu: its output is what backward keeps
                act_MN = tl.maximum(acc_MN, 0)
            else:
                tl.store(pre_ptr + rows_M[:, None] * F + n_N[None, :], acc_MN.to(out_dtype), mask=mask_MN)
                tl.store(pre_ptr + rows_M[:, None] * F + H + n_N[None, :], up_MN.to(out_dtype), mask=mask_MN)
                if ACTIVATION == 1:     # swiglu
                    act_MN = acc_MN / (1 + tl.exp(-acc_MN)) * up_MN
                else:                   # geglu (exact gelu)
                    act_MN = 0.5 * acc_MN * (1 + tl.erf(acc_MN * 0.7071067811865476)) * up_MN
            tl.store(act_ptr + rows_M[:, None] * H + n_N[None, :], act_MN.to(out_dtype), mask=mask_MN)
