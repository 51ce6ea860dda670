"""The routing kernels in Triton, for CUDA tensors: same signatures and results as torch_ops.py; and
more that keep a GPU step free of passes over whole tensors: zero_rows_past (zeroes only the rows
past a device-held end), add_bias_rows (each group's bias added in place, one pass), grouped_sum (bias
gradients: per-group column sums, no atomics) and SwiGLU forward and backward in one pass each (plain and
clamped).

Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, E experts, K top-k, R routed rows (kept choices,
grouped by expert)).
pos_TK[t, k] is the routed row of token t's k-th choice, -1 where the choice was dropped.

Sums and dot products accumulate in fp32 (fp64 for fp64 inputs) and are cast on store. The module
imports without triton, so available() can say why it is not used; the ops then raise ImportError.
On CPU tensors the kernels run only under TRITON_INTERPRET=1, set before triton is imported (the tests
do so in a child process).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from moe_plugin.ops import torch_ops

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_MISSING = "triton is not installed (pip install triton, or pip install moe_plugin[triton])"
_ROUTE_BLOCK = 1024     # choices per step of the per-expert scan
_MAX_TILE = 4096        # elements of one [BLOCK_K, BLOCK_D] tile in scatter_rows / gather_sum
_ROWS = 16              # rows per step of grouped_sum
_ZERO_ROWS = 64         # rows per program of zero_rows_past
_COLUMNS = 256          # columns per program of zero_rows_past and grouped_sum
_ELEMENTWISE = 1024     # elements per program of the SwiGLU kernels (_row_tiles)


def available() -> Tuple[bool, str]:
    """(True, "") when triton imports and a CUDA device is present, else (False, why not)."""
    if triton is None:
        return False, _MISSING
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, ""


def _require_triton() -> None:
    if triton is None:
        raise ImportError(f"moe_plugin.ops.triton_kernels: {_MISSING}")


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output is allocated here (tests patch it to fill with poison)."""
    return torch.empty(shape, dtype=dtype, device=device)


def route_slots(expert_TK: torch.Tensor, order_T: Optional[torch.Tensor], row_start_E: torch.Tensor,
                capacity: int, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """See torch_ops.route_slots: one program per expert scans all choices in visiting order."""
    _require_triton()
    T, K = expert_TK.shape
    device = expert_TK.device
    pos_TK = _empty((T, K), torch.long, device)
    token_R = _empty((num_rows,), torch.long, device)
    if T == 0:
        return pos_TK, token_R
    E = row_start_E.shape[0]
    block = min(_ROUTE_BLOCK, next_power_of_2(T * K))
    _route_slots_kernel[(E,)](expert_TK.contiguous(), _or(order_T, expert_TK), row_start_E.contiguous(),
                              pos_TK, token_R, T, K, capacity, HAS_ORDER=order_T is not None, BLOCK=block)
    return pos_TK, token_R


def scatter_rows(src_TD: torch.Tensor, pos_TK: torch.Tensor, scale_TK: Optional[torch.Tensor],
                 other_RD: Optional[torch.Tensor], num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """See torch_ops.scatter_rows: one program per token writes its K rows."""
    _require_triton()
    T, D = src_TD.shape
    K = pos_TK.shape[1]
    out_RD = _empty((num_rows, D), src_TD.dtype, src_TD.device)
    dot_TK = _empty(pos_TK.shape if other_RD is not None else (0,), src_TD.dtype, src_TD.device)
    if T == 0:
        return out_RD, dot_TK
    src_TD = src_TD.contiguous()
    block_k, block_d = _blocks(K, D)
    _scatter_rows_kernel[(T,)](
        src_TD, pos_TK.contiguous(), _or(scale_TK, src_TD), _or(other_RD, src_TD), out_RD, dot_TK, D, K,
        HAS_SCALE=scale_TK is not None, HAS_OTHER=other_RD is not None, ACC=_acc_dtype(src_TD),
        BLOCK_K=block_k, BLOCK_D=block_d)
    return out_RD, dot_TK


def gather_sum(src_RD: torch.Tensor, pos_TK: torch.Tensor, scale_TK: Optional[torch.Tensor],
               other_TD: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """See torch_ops.gather_sum: one program per token reads its K rows."""
    _require_triton()
    T, K = pos_TK.shape
    D = src_RD.shape[1]
    out_TD = _empty((T, D), src_RD.dtype, src_RD.device)
    dot_dtype = other_TD.dtype if other_TD is not None else src_RD.dtype
    dot_TK = _empty(pos_TK.shape if other_TD is not None else (0,), dot_dtype, src_RD.device)
    if T == 0:
        return out_TD, dot_TK
    src_RD = src_RD.contiguous()
    block_k, block_d = _blocks(K, D)
    _gather_sum_kernel[(T,)](
        src_RD, pos_TK.contiguous(), _or(scale_TK, src_RD), _or(other_TD, src_RD), out_TD, dot_TK, D, K,
        HAS_SCALE=scale_TK is not None, HAS_OTHER=other_TD is not None, ACC=_acc_dtype(src_RD),
        BLOCK_K=block_k, BLOCK_D=block_d)
    return out_TD, dot_TK


def zero_rows_past(out_RO: torch.Tensor, end: torch.Tensor) -> None:
    """out_RO[end:] = 0 for a 0-dim integer tensor end on out_RO's device (contiguous out_RO): programs whose
    rows all lie below end store nothing, so a step that keeps every row costs one launch."""
    _require_triton()
    R, O = out_RO.shape
    if R == 0 or O == 0:
        return
    block_o = min(next_power_of_2(O), _COLUMNS)
    grid = (cdiv(R, _ZERO_ROWS), cdiv(O, block_o))
    _zero_rows_past_kernel[grid](out_RO, end, R, O, BLOCK_R=_ZERO_ROWS, BLOCK_O=block_o)


def grouped_sum(x_RO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[E, O]: the sum of each group's rows (groups end at offs_E, int32, on the device), in x_RO's dtype,
    accumulated in fp32 (fp64 for fp64); rows past the last offset belong to no group."""
    _require_triton()
    R, O = x_RO.shape
    E = offs_E.shape[0]
    sums_EO = _empty((E, O), x_RO.dtype, x_RO.device)
    if E == 0 or O == 0:
        return sums_EO
    block_o = min(next_power_of_2(O), _COLUMNS)
    _grouped_sum_kernel[(E, cdiv(O, block_o))](x_RO.contiguous(), offs_E.contiguous(), sums_EO, O,
                                               ACC=_acc_dtype(x_RO), BLOCK_R=_ROWS, BLOCK_O=block_o)
    return sums_EO


def add_bias_rows(out_RO: torch.Tensor, bias_EO: torch.Tensor, offs_E: torch.Tensor) -> None:
    """out_RO[r] += bias_EO[e] for each row r of group e (groups end at offs_E, int32, on the device), in place
    (contiguous out_RO); rows past the last offset untouched."""
    _require_triton()
    R, O = out_RO.shape
    E = offs_E.shape[0]
    if R == 0 or O == 0 or E == 0:
        return
    block_o = min(next_power_of_2(O), _COLUMNS)
    grid = (cdiv(R, _ZERO_ROWS), cdiv(O, block_o))
    _add_bias_rows_kernel[grid](out_RO, bias_EO.contiguous(), offs_E.contiguous(), R, O, E, BLOCK_R=_ZERO_ROWS,
                                BLOCK_O=block_o, BLOCK_E=next_power_of_2(E))


def bias_dot_and_scale_(grad_RO: torch.Tensor, bias_EO: torch.Tensor, offs_E: torch.Tensor, scale_R1: torch.Tensor,
                        dot_R: torch.Tensor) -> None:
    """In place, in one pass over each grouped row r of group e (groups end at offs_E, int32, on the device):
    dot_R[r] += <grad_RO[r], bias_EO[e]> (accumulated in fp32, or fp64 for fp64), then grad_RO[r] *= scale_R1[r]
    (multiplied in fp32 and rounded once, as torch does). The expert layer's lean backward with a second bias: that
    bias's share of the gate gradient, then the gate scale of the rows' output gradient. Rows past the last offset
    untouched; grad_RO contiguous."""
    _require_triton()
    R, O = grad_RO.shape
    E = offs_E.shape[0]
    if R == 0 or O == 0 or E == 0:
        return
    block, block_r = _row_tiles(O)
    _bias_dot_scale_kernel[(cdiv(R, block_r),)](grad_RO, bias_EO.contiguous(), offs_E.contiguous(),
                                                 scale_R1.contiguous(), dot_R, R, O, E, ACC=_acc_dtype(grad_RO),
                                                 BLOCK_R=block_r, BLOCK_O=block, BLOCK_E=next_power_of_2(E))


def swiglu_forward(pre_RH2: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up] [R, 2H] -> [R, H], in one pass."""
    return _swiglu(pre_RH2, None, None)[1]


def swiglu_backward(grad_RH: torch.Tensor, pre_RH2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad of pre [R, 2H], the activations [R, H]) in one pass over pre and the gradient."""
    return _swiglu(pre_RH2, grad_RH, None)


def clamped_swiglu_forward(pre_RH2: torch.Tensor, limit: float, alpha: float, beta: float) -> torch.Tensor:
    """See torch_ops.clamped_swiglu_forward, in one pass (fp64 in torch: Triton takes float scalars as fp32)."""
    if pre_RH2.dtype == torch.float64:
        return torch_ops.clamped_swiglu_forward(pre_RH2, limit, alpha, beta)
    return _swiglu(pre_RH2, None, (limit, alpha, beta))[1]


def clamped_swiglu_backward(grad_RH: torch.Tensor, pre_RH2: torch.Tensor, limit: float, alpha: float, beta: float
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """See torch_ops.clamped_swiglu_backward, in one pass (fp64 in torch, as the forward)."""
    if pre_RH2.dtype == torch.float64:
        return torch_ops.clamped_swiglu_backward(grad_RH, pre_RH2, limit, alpha, beta)
    return _swiglu(pre_RH2, grad_RH, (limit, alpha, beta))


def _swiglu(pre_RH2: torch.Tensor, grad_RH: Optional[torch.Tensor], clamp: Optional[Tuple[float, float, float]]
            ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(grad of pre, activations); the gradient None in forward (grad_RH None)."""
    _require_triton()
    R, H = pre_RH2.shape[0], pre_RH2.shape[1] // 2
    pre_RH2 = pre_RH2.contiguous()
    act_RH = _empty((R, H), pre_RH2.dtype, pre_RH2.device)
    grad_pre_RH2 = None if grad_RH is None else _empty((R, 2 * H), pre_RH2.dtype, pre_RH2.device)
    if R and H:
        limit, alpha, beta = clamp if clamp is not None else (0.0, 1.0, 0.0)
        block, block_r = _row_tiles(H)
        _swiglu_kernel[(cdiv(R, block_r), cdiv(H, block))](
            pre_RH2, _or(grad_RH, pre_RH2), act_RH, _or(grad_pre_RH2, act_RH), R, H, limit, alpha, beta,
            BACKWARD=grad_RH is not None, CLAMPED=clamp is not None, ACC=_acc_dtype(pre_RH2), BLOCK=block,
            BLOCK_R=block_r)
    return grad_pre_RH2, act_RH


def swiglu_backward_scaled(grad_RH: torch.Tensor, pre_RH2: torch.Tensor, scale_R1: torch.Tensor,
                           clamp: Optional[Tuple[float, float, float]] = None, scale_act: bool = False
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale_R1 * grad of pre [R, 2H], the activations [R, H] (times scale_R1 with scale_act), dot_R =
    <grad_RH[r], act[r]> in fp32) in one pass (a program per tile of rows, _row_tiles): SwiGLU's backward with each
    row's gate scale and its gate gradient (the fused layer's lean backward, experts.mlp_backward). clamp: (limit,
    alpha, beta) as clamped_swiglu_backward, or None."""
    _require_triton()
    R, H = pre_RH2.shape[0], pre_RH2.shape[1] // 2
    pre_RH2 = pre_RH2.contiguous()
    act_RH = _empty((R, H), pre_RH2.dtype, pre_RH2.device)
    grad_pre_RH2 = _empty((R, 2 * H), pre_RH2.dtype, pre_RH2.device)
    dot_R = _empty((R,), torch.float64 if pre_RH2.dtype == torch.float64 else torch.float32, pre_RH2.device)
    if R:
        limit, alpha, beta = clamp if clamp is not None else (0.0, 1.0, 0.0)
        block, block_r = _row_tiles(H)
        _swiglu_scaled_kernel[(cdiv(R, block_r),)](
            pre_RH2, grad_RH.contiguous(), scale_R1.contiguous(), act_RH, grad_pre_RH2, dot_R, R, H, limit, alpha,
            beta, CLAMPED=clamp is not None, SCALE_ACT=scale_act, ACC=_acc_dtype(pre_RH2), BLOCK=block,
            BLOCK_R=block_r)
    return grad_pre_RH2, act_RH, dot_R


def _row_tiles(H: int) -> Tuple[int, int]:
    """(columns, rows) of a SwiGLU program's tile: up to _ELEMENTWISE elements, several rows where H is narrow (a
    program per row of 256 columns made 196,608 tiny programs at the SonicMoE shape)."""
    block = min(next_power_of_2(max(H, 1)), _ELEMENTWISE)
    return block, _ELEMENTWISE // block


def cdiv(a: int, b: int) -> int:
    """triton.cdiv in plain Python: Triton's own is a constexpr function, 2 us a call from the host (34 calls a
    step of the layer)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 in plain Python (0 for 0, as Triton's), for the same reason."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _or(x: Optional[torch.Tensor], stand_in: torch.Tensor) -> torch.Tensor:
    """A missing optional input is passed as a stand-in pointer that the kernel never reads."""
    return stand_in if x is None else x.contiguous()


def _acc_dtype(x: torch.Tensor):
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _blocks(K: int, D: int) -> Tuple[int, int]:
    block_k = next_power_of_2(K)
    return block_k, min(next_power_of_2(max(D, 1)), _MAX_TILE // block_k)


if triton is not None:

    @triton.jit
    def _route_slots_kernel(expert_ptr, order_ptr, row_start_ptr, pos_ptr, token_ptr, T, K, capacity,
                            HAS_ORDER: tl.constexpr, BLOCK: tl.constexpr):
        e = tl.program_id(0)
        row_start = tl.load(row_start_ptr + e).to(tl.int64)
        taken = tl.full([], 0, tl.int64)    # choices of expert e seen so far
        for begin in range(0, T * K, BLOCK):
            # visit a = k * T + i: choice-major, the i-th token of the order
            a_A = begin + tl.arange(0, BLOCK)
            valid_A = a_A < T * K
            k_A = a_A // T
            i_A = a_A % T
            if HAS_ORDER:
                t_A = tl.load(order_ptr + i_A, mask=valid_A, other=0).to(tl.int64)
            else:
                t_A = i_A.to(tl.int64)
            expert_A = tl.load(expert_ptr + t_A * K + k_A, mask=valid_A, other=-1)
            mine_A = expert_A == e
            slot_A = taken + tl.cumsum(mine_A.to(tl.int32), 0).to(tl.int64) - 1
            kept_A = mine_A & (slot_A < capacity)
            row_A = tl.where(kept_A, row_start + slot_A, -1)
            tl.store(pos_ptr + t_A * K + k_A, row_A, mask=mine_A)
            tl.store(token_ptr + row_A, t_A, mask=kept_A)
            taken += tl.sum(mine_A.to(tl.int64), 0)

    @triton.jit
    def _token_choices(pos_ptr, scale_ptr, t, K, HAS_SCALE: tl.constexpr, ACC: tl.constexpr, BLOCK_K: tl.constexpr):
        """Token t's choices: their rows (-1 dropped), whether kept, and their scales (1 without scale_ptr)."""
        k_K = tl.arange(0, BLOCK_K)
        pos_K = tl.load(pos_ptr + t * K + k_K, mask=k_K < K, other=-1)
        kept_K = pos_K >= 0
        if HAS_SCALE:
            scale_K = tl.load(scale_ptr + t * K + k_K, mask=kept_K, other=0).to(ACC)
        else:
            scale_K = tl.full([BLOCK_K], 1, ACC)
        return k_K, pos_K, kept_K, scale_K

    @triton.jit
    def _scatter_rows_kernel(src_ptr, pos_ptr, scale_ptr, other_ptr, out_ptr, dot_ptr, D, K,
                             HAS_SCALE: tl.constexpr, HAS_OTHER: tl.constexpr, ACC: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k_K, pos_K, kept_K, scale_K = _token_choices(pos_ptr, scale_ptr, t, K, HAS_SCALE, ACC, BLOCK_K)
        dot_K = tl.zeros([BLOCK_K], ACC)
        for begin in range(0, D, BLOCK_D):
            d_D = begin + tl.arange(0, BLOCK_D)
            src_D = tl.load(src_ptr + t * D + d_D, mask=d_D < D, other=0).to(ACC)
            row_KD = pos_K[:, None] * D + d_D[None, :]
            mask_KD = kept_K[:, None] & (d_D < D)[None, :]
            out_KD = scale_K[:, None] * src_D[None, :]
            tl.store(out_ptr + row_KD, out_KD.to(out_ptr.dtype.element_ty), mask=mask_KD)
            if HAS_OTHER:
                other_KD = tl.load(other_ptr + row_KD, mask=mask_KD, other=0).to(ACC)
                dot_K += tl.sum(other_KD * src_D[None, :], axis=1)
        if HAS_OTHER:
            tl.store(dot_ptr + t * K + k_K, dot_K.to(dot_ptr.dtype.element_ty), mask=k_K < K)

    @triton.jit
    def _gather_sum_kernel(src_ptr, pos_ptr, scale_ptr, other_ptr, out_ptr, dot_ptr, D, K,
                           HAS_SCALE: tl.constexpr, HAS_OTHER: tl.constexpr, ACC: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k_K, pos_K, kept_K, scale_K = _token_choices(pos_ptr, scale_ptr, t, K, HAS_SCALE, ACC, BLOCK_K)
        dot_K = tl.zeros([BLOCK_K], ACC)
        for begin in range(0, D, BLOCK_D):
            d_D = begin + tl.arange(0, BLOCK_D)
            mask_KD = kept_K[:, None] & (d_D < D)[None, :]
            rows_KD = tl.load(src_ptr + pos_K[:, None] * D + d_D[None, :], mask=mask_KD, other=0).to(ACC)
            out_D = tl.sum(scale_K[:, None] * rows_KD, axis=0)
            tl.store(out_ptr + t * D + d_D, out_D.to(out_ptr.dtype.element_ty), mask=d_D < D)
            if HAS_OTHER:
                other_D = tl.load(other_ptr + t * D + d_D, mask=d_D < D, other=0).to(ACC)
                dot_K += tl.sum(rows_KD * other_D[None, :], axis=1)
        if HAS_OTHER:
            tl.store(dot_ptr + t * K + k_K, dot_K.to(dot_ptr.dtype.element_ty), mask=k_K < K)

    @triton.jit
    def _zero_rows_past_kernel(out_ptr, end_ptr, R, O, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
        first = tl.program_id(0).to(tl.int64) * BLOCK_R
        end = tl.load(end_ptr).to(tl.int64)
        if first + BLOCK_R > end:
            r_R = first + tl.arange(0, BLOCK_R)
            o_O = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
            mask_RO = ((r_R >= end) & (r_R < R))[:, None] & (o_O < O)[None, :]
            zeros_RO = tl.zeros([BLOCK_R, BLOCK_O], out_ptr.dtype.element_ty)
            tl.store(out_ptr + r_R[:, None] * O + o_O[None, :], zeros_RO, mask=mask_RO)

    @triton.jit
    def _add_bias_rows_kernel(out_ptr, bias_ptr, offs_ptr, R, O, E, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr,
                              BLOCK_E: tl.constexpr):
        r_R = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        o_O = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        e_E = tl.arange(0, BLOCK_E)
        offs_E = tl.load(offs_ptr + e_E, mask=e_E < E, other=2147483647).to(tl.int64)
        group_R = tl.sum((offs_E[None, :] <= r_R[:, None]).to(tl.int32), axis=1)     # E past the last offset
        mask_RO = ((r_R < R) & (group_R < E))[:, None] & (o_O < O)[None, :]
        bias_RO = tl.load(bias_ptr + group_R[:, None].to(tl.int64) * O + o_O[None, :], mask=mask_RO, other=0)
        out_RO = tl.load(out_ptr + r_R[:, None] * O + o_O[None, :], mask=mask_RO, other=0)
        if out_ptr.dtype.element_ty != tl.float64:     # added in fp32 and rounded once, as torch does
            bias_RO = bias_RO.to(tl.float32)
            out_RO = out_RO.to(tl.float32)
        tl.store(out_ptr + r_R[:, None] * O + o_O[None, :], (out_RO + bias_RO).to(out_ptr.dtype.element_ty),
                 mask=mask_RO)

    @triton.jit
    def _bias_dot_scale_kernel(grad_ptr, bias_ptr, offs_ptr, scale_ptr, dot_ptr, R, O, E, ACC: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_E: tl.constexpr):
        r_R = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        e_E = tl.arange(0, BLOCK_E)
        offs_E = tl.load(offs_ptr + e_E, mask=e_E < E, other=2147483647).to(tl.int64)
        group_R = tl.sum((offs_E[None, :] <= r_R[:, None]).to(tl.int32), axis=1)     # E past the last offset
        valid_R = (r_R < R) & (group_R < E)
        scale_R = tl.load(scale_ptr + r_R, mask=valid_R, other=0).to(ACC)
        acc_R = tl.zeros([BLOCK_R], ACC)
        for begin in range(0, O, BLOCK_O):
            o_O = begin + tl.arange(0, BLOCK_O)
            mask_RO = valid_R[:, None] & (o_O < O)[None, :]
            grad_RO = tl.load(grad_ptr + r_R[:, None] * O + o_O[None, :], mask=mask_RO, other=0).to(ACC)
            bias_RO = tl.load(bias_ptr + group_R[:, None].to(tl.int64) * O + o_O[None, :], mask=mask_RO,
                              other=0).to(ACC)
            acc_R += tl.sum(grad_RO * bias_RO, axis=1)
            tl.store(grad_ptr + r_R[:, None] * O + o_O[None, :], (grad_RO * scale_R[:, None]).to(
                grad_ptr.dtype.element_ty), mask=mask_RO)
        dot_R = tl.load(dot_ptr + r_R, mask=valid_R, other=0)
        tl.store(dot_ptr + r_R, dot_R + acc_R.to(dot_ptr.dtype.element_ty), mask=valid_R)

    @triton.jit
    def _grouped_sum_kernel(x_ptr, offs_ptr, sums_ptr, O, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_O: tl.constexpr):
        e = tl.program_id(0)
        o_O = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        end = tl.load(offs_ptr + e).to(tl.int64)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        acc_O = tl.zeros([BLOCK_O], ACC)
        for begin in range(start, end, BLOCK_R):
            r_R = begin + tl.arange(0, BLOCK_R)
            mask_RO = (r_R < end)[:, None] & (o_O < O)[None, :]
            acc_O += tl.sum(tl.load(x_ptr + r_R[:, None] * O + o_O[None, :], mask=mask_RO, other=0).to(ACC), axis=0)
        tl.store(sums_ptr + e * O + o_O, acc_O.to(sums_ptr.dtype.element_ty), mask=o_O < O)

    @triton.jit
    def _swiglu_parts(gate, up, limit, alpha, beta, CLAMPED: tl.constexpr):
        """(act, d act / d gate, d act / d up) of (up + beta) * g * sigmoid(alpha * g), g the gate; clamped: the gate
        at most limit, up within [-limit, limit], each derivative 0 where its input was clamped."""
        if CLAMPED:
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
        else:
            g = gate
            u = up
        sig = 1 / (1 + tl.exp(-(alpha * g)))
        glu = g * sig
        d_gate = (u + beta) * (sig + alpha * glu * (1 - sig))
        d_up = glu
        if CLAMPED:
            d_gate = tl.where(gate <= limit, d_gate, 0)
            d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0)
        return (u + beta) * glu, d_gate, d_up

    @triton.jit
    def _swiglu_kernel(pre_ptr, grad_ptr, act_ptr, grad_pre_ptr, R, H, limit, alpha, beta, BACKWARD: tl.constexpr,
                       CLAMPED: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
        r_R = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        h_H = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask_RH = (r_R < R)[:, None] & (h_H < H)[None, :]
        pre_RH = r_R[:, None] * 2 * H + h_H[None, :]
        out_RH = r_R[:, None] * H + h_H[None, :]
        gate_RH = tl.load(pre_ptr + pre_RH, mask=mask_RH, other=0).to(ACC)
        up_RH = tl.load(pre_ptr + pre_RH + H, mask=mask_RH, other=0).to(ACC)
        act_RH, d_gate_RH, d_up_RH = _swiglu_parts(gate_RH, up_RH, limit, alpha, beta, CLAMPED)
        tl.store(act_ptr + out_RH, act_RH.to(act_ptr.dtype.element_ty), mask=mask_RH)
        if BACKWARD:
            grad_RH = tl.load(grad_ptr + out_RH, mask=mask_RH, other=0).to(ACC)
            grad_gate_RH = grad_RH * d_gate_RH
            grad_up_RH = grad_RH * d_up_RH
            out_dtype = grad_pre_ptr.dtype.element_ty
            tl.store(grad_pre_ptr + pre_RH, grad_gate_RH.to(out_dtype), mask=mask_RH)
            tl.store(grad_pre_ptr + pre_RH + H, grad_up_RH.to(out_dtype), mask=mask_RH)

    @triton.jit
    def _swiglu_scaled_kernel(pre_ptr, grad_ptr, scale_ptr, act_ptr, grad_pre_ptr, dot_ptr, R, H, limit, alpha, beta,
                              CLAMPED: tl.constexpr, SCALE_ACT: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr,
                              BLOCK_R: tl.constexpr):
        r_R = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        valid_R = r_R < R
        scale_R = tl.load(scale_ptr + r_R, mask=valid_R, other=0).to(ACC)
        dot_RH = tl.zeros([BLOCK_R, BLOCK], ACC)
        for begin in range(0, H, BLOCK):
            h_H = begin + tl.arange(0, BLOCK)
            mask_RH = valid_R[:, None] & (h_H < H)[None, :]
            pre_RH = r_R[:, None] * 2 * H + h_H[None, :]
            out_RH = r_R[:, None] * H + h_H[None, :]
            gate_RH = tl.load(pre_ptr + pre_RH, mask=mask_RH, other=0).to(ACC)
            up_RH = tl.load(pre_ptr + pre_RH + H, mask=mask_RH, other=0).to(ACC)
            act_RH, d_gate_RH, d_up_RH = _swiglu_parts(gate_RH, up_RH, limit, alpha, beta, CLAMPED)
            written_RH = scale_R[:, None] * act_RH if SCALE_ACT else act_RH
            tl.store(act_ptr + out_RH, written_RH.to(act_ptr.dtype.element_ty), mask=mask_RH)
            grad_RH = tl.load(grad_ptr + out_RH, mask=mask_RH, other=0).to(ACC)
            dot_RH += grad_RH * act_RH       # the activations as stored would round them: the exact product
            grad_gate_RH = scale_R[:, None] * grad_RH * d_gate_RH
            grad_up_RH = scale_R[:, None] * grad_RH * d_up_RH
            out_dtype = grad_pre_ptr.dtype.element_ty
            tl.store(grad_pre_ptr + pre_RH, grad_gate_RH.to(out_dtype), mask=mask_RH)
            tl.store(grad_pre_ptr + pre_RH + H, grad_up_RH.to(out_dtype), mask=mask_RH)
        tl.store(dot_ptr + r_R, tl.sum(dot_RH, 1).to(dot_ptr.dtype.element_ty), mask=valid_R)
