"""Routing in four Triton kernels, for CUDA tensors: what the router, the balance and z losses, route planning
and the gate finalization (router.py, dispatch.plan_routes, router.finalize_gates) do in about 40 launches
forward and backward. Softmax router, top-k by score, gates normalized before or after dropping or not at all.

  route_forward    per block of tokens: logits (fp32 accumulation), softmax, top-k, normalized gates, and per
                   block the choices per expert of each k (histograms), the probability sums and the z-loss sum
  route_plan       one program: an exclusive scan of the histograms in visiting order (choice-major, tokens in
                   order) gives each block its first slot per expert; loads, kept rows, end offsets; the loss
  route_slots      per block of tokens: each choice's slot (its block's first slot + its rank in the block),
                   routed row or -1 past the cap, and the final gates in the compute dtype
  route_backward   per block of tokens: the logits' gradient from the final gates' and the loss's gradients

The histogram + scan replaces the E programs that each rescan all T*K choices (triton_kernels.route_slots).
Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, E experts, K top-k, B token blocks).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .triton_kernels import _or, cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_T = 32          # tokens per program
_TILE = 8192          # elements of one [BLOCK_T, BLOCK_E] tile at most


def block_t(E: int) -> int:
    return max(16, min(BLOCK_T, _TILE // next_power_of_2(E)))


def block_e(E: int) -> int:
    return max(16, next_power_of_2(E))


def _empty(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


def route(x_TD, w_ED, K: int, normalize: str, scale: float, cap: int, aux_kind: str, aux_scale: float,
          z_scale: float, gate_dtype: torch.dtype, stats: tuple = (), final_R: Optional[torch.Tensor] = None):
    """torch_route.route's contract in three kernels: (final_TK, aux, pos_TK, kept_TK, load_E, kept_E, offs_E) and
    what route_backward needs (expert_TK, gate_TK: the gates before dropping, probs_TE, lse_T, aux_grad_E). stats:
    route_plan's (load_E, kept_E, aux_value) to write, or (); final_R: route_slots' per-row gates to write, or None."""
    expert_TK, gate_TK, probs_TE, hist_AE, psum_BE, zsum_B, lse_T = route_forward(
        x_TD, w_ED, K, normalize == "before_drop", z_scale != 0)
    first_AE, load_E, kept_E, offs_E, aux, aux_grad_E = route_plan(
        hist_AE, psum_BE, zsum_B, x_TD.shape[0], K, cap, aux_kind, aux_scale, z_scale, *stats)
    pos_TK, kept_TK, final_TK = route_slots(expert_TK, gate_TK, first_AE, kept_E, offs_E, cap,
                                            normalize == "after_drop", scale, gate_dtype, final_R)
    return (final_TK, aux, pos_TK, kept_TK, load_E, kept_E, offs_E), (expert_TK, gate_TK, probs_TE, lse_T, aux_grad_E)


def route_forward(x_TD, w_ED, K: int, normalize_before: bool, with_z: bool):
    """(expert_TK int64, gate_TK fp32 (normalized when normalize_before), probs_TE fp32, hist_AE int32 [K*B, E],
    psum_BE fp32, zsum_B fp32, lse_T fp32)."""
    T, D = x_TD.shape
    E = w_ED.shape[0]
    device = x_TD.device
    bt = block_t(E)
    B = cdiv(T, bt)
    expert_TK = _empty((T, K), torch.long, device)
    gate_TK = _empty((T, K), torch.float32, device)
    probs_TE = _empty((T, E), torch.float32, device)
    hist_AE = _empty((K * B, E), torch.int32, device)
    psum_BE = _empty((B, E), torch.float32, device)
    zsum_B = _empty((B,), torch.float32, device)
    lse_T = _empty((T,), torch.float32, device)
    block_d = max(16, min(64, next_power_of_2(D)))
    # bf16 / fp16 products are exact in fp32: the dot runs in the inputs' dtype, accumulating in fp32 (the same
    # sums as in fp32, in another order); the Triton interpreter's bf16 dot is wrong (triton 3.9), so there in fp32
    same = x_TD.dtype == w_ED.dtype and x_TD.dtype in (torch.bfloat16, torch.float16) and not INTERPRETER
    _route_forward_kernel[(B,)](x_TD, w_ED, expert_TK, gate_TK, probs_TE, hist_AE, psum_BE, zsum_B, lse_T,
                                T, D, E, B, K=K, BLOCK_K=next_power_of_2(K), NORMALIZE=normalize_before,
                                WITH_Z=with_z, LOW_PRECISION=same, BLOCK_T=bt, BLOCK_E=block_e(E), BLOCK_D=block_d)
    return expert_TK, gate_TK, probs_TE, hist_AE, psum_BE, zsum_B, lse_T


def route_plan(hist_AE, psum_BE, zsum_B, T: int, K: int, cap: int, aux_kind: str, aux_scale: float, z_scale: float,
               load_E=None, kept_E=None, aux_copy=None):
    """(first_AE int32, load_E int64, kept_E int64, offs_E int32, aux fp32 [], aux_grad_E fp32): aux is
    aux_scale * sum_e(probability sum_e * counted choices_e) + z_scale * sum of lse^2, and aux_grad_E its gradient
    with respect to each token's probability of e. load_E and kept_E may be given (persistent buffers); aux_copy, a
    persistent fp32 [] tensor, gets aux's value too (no copy kernel after)."""
    A, E = hist_AE.shape
    B = A // K
    device = hist_AE.device
    first_AE = _empty((A, E), torch.int32, device)
    load_E = _empty((E,), torch.long, device) if load_E is None else load_E
    kept_E = _empty((E,), torch.long, device) if kept_E is None else kept_E
    offs_E = _empty((E,), torch.int32, device)
    aux = _empty((), torch.float32, device)
    aux_grad_E = _empty((E,), torch.float32, device)
    counted_rows = B if aux_kind == "gshard" else A
    _route_plan_kernel[(1,)](hist_AE, psum_BE, zsum_B, first_AE, load_E, kept_E, offs_E, aux, aux_grad_E,
                             aux if aux_copy is None else aux_copy, E, B, A, counted_rows, cap, aux_scale, z_scale,
                             BLOCK_E=block_e(E), BLOCK_A=max(1, min(64, _TILE // block_e(E))))
    return first_AE, load_E, kept_E, offs_E, aux, aux_grad_E


def route_slots(expert_TK, gate_TK, first_AE, kept_E, offs_E, cap: int, after_drop: bool, scale: float,
                gate_dtype: torch.dtype, final_R: Optional[torch.Tensor] = None):
    """(pos_TK int64: routed row or -1, kept_TK bool, final_TK in gate_dtype: gates zeroed where dropped,
    renormalized over the kept ones when after_drop, times scale). final_R (gate_dtype, T*K rows), if given: each
    kept choice's final gate is also written at its row (the rows no choice names are left as they are)."""
    T, K = expert_TK.shape
    E = offs_E.shape[0]
    device = expert_TK.device
    bt = block_t(E)
    pos_TK = _empty((T, K), torch.long, device)
    kept_TK = _empty((T, K), torch.bool, device)
    final_TK = _empty((T, K), gate_dtype, device)
    _route_slots_kernel[(cdiv(T, bt),)](expert_TK, gate_TK, first_AE, kept_E, offs_E, pos_TK, kept_TK, final_TK,
                                        _or(final_R, final_TK), T, E, cdiv(T, bt), cap, scale, K=K,
                                        BLOCK_K=next_power_of_2(K), AFTER_DROP=after_drop,
                                        ROWS=final_R is not None, BLOCK_T=bt, BLOCK_E=block_e(E))
    return pos_TK, kept_TK, final_TK


def route_backward(grad_final_TK, grad_aux, expert_TK, gate_TK, pos_TK, probs_TE, lse_T, aux_grad_E,
                   normalize: str, scale: float, z_scale: float, out_dtype: torch.dtype, by_row: bool = False):
    """grad_logits_TE in out_dtype from the final gates' gradient (None: 0) and the loss's (None: 0). by_row: the
    final gates' gradient is given per routed row ([T*K], the gradient of route_slots' final_R), read at each kept
    choice's row."""
    T, E = probs_TE.shape
    K = expert_TK.shape[1]
    bt = block_t(E)
    grad_TE = _empty((T, E), out_dtype, probs_TE.device)
    _route_backward_kernel[(cdiv(T, bt),)](
        grad_final_TK if grad_final_TK is not None else gate_TK, grad_aux if grad_aux is not None else gate_TK,
        expert_TK, gate_TK, pos_TK, probs_TE, lse_T, aux_grad_E, grad_TE, T, E, scale, z_scale, K=K,
        BLOCK_K=next_power_of_2(K), HAS_GRAD_GATE=grad_final_TK is not None, BY_ROW=by_row,
        HAS_GRAD_AUX=grad_aux is not None, NORMALIZE={"none": 0, "before_drop": 1, "after_drop": 2}[normalize],
        BLOCK_T=bt, BLOCK_E=block_e(E))
    return grad_TE


if triton is not None:

    @triton.jit
    def _route_forward_kernel(x_ptr, w_ptr, expert_ptr, gate_ptr, probs_ptr, hist_ptr, psum_ptr, zsum_ptr, lse_ptr,
                              T, D, E, B, K: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
                              WITH_Z: tl.constexpr, LOW_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        t_T = b * BLOCK_T + tl.arange(0, BLOCK_T)
        e_E = tl.arange(0, BLOCK_E)
        valid_T = t_T < T
        valid_E = e_E < E
        logits_TE = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for begin in range(0, D, BLOCK_D):
            d_D = begin + tl.arange(0, BLOCK_D)
            x_TD = tl.load(x_ptr + t_T[:, None].to(tl.int64) * D + d_D[None, :],
                           mask=valid_T[:, None] & (d_D < D)[None, :], other=0)
            w_ED = tl.load(w_ptr + e_E[:, None] * D + d_D[None, :], mask=valid_E[:, None] & (d_D < D)[None, :],
                           other=0)
            if LOW_PRECISION:
                logits_TE += tl.dot(x_TD, tl.trans(w_ED))
            else:
                logits_TE += tl.dot(x_TD.to(tl.float32), tl.trans(w_ED.to(tl.float32)), input_precision="ieee")
        logits_TE = tl.where(valid_E[None, :], logits_TE, -float("inf"))
        max_T = tl.max(logits_TE, axis=1)
        exp_TE = tl.exp(logits_TE - max_T[:, None])
        sum_T = tl.sum(exp_TE, axis=1)
        probs_TE = exp_TE / sum_T[:, None]
        mask_TE = valid_T[:, None] & valid_E[None, :]
        tl.store(probs_ptr + t_T[:, None].to(tl.int64) * E + e_E[None, :], probs_TE, mask=mask_TE)
        tl.store(psum_ptr + b * E + e_E, tl.sum(tl.where(mask_TE, probs_TE, 0.0), axis=0), mask=valid_E)
        if WITH_Z:
            lse_T = max_T + tl.log(sum_T)
            tl.store(lse_ptr + t_T, lse_T, mask=valid_T)
            tl.store(zsum_ptr + b, tl.sum(tl.where(valid_T, lse_T * lse_T, 0.0), axis=0))
        else:   # route_plan adds z_scale (0) x zsum: never x garbage, which may be NaN or inf
            tl.store(zsum_ptr + b, 0.0)

        # top-k, best first: the largest probability, then the largest of the rest (ties: the lower expert)
        k_K = tl.arange(0, BLOCK_K)
        left_TE = tl.where(valid_E[None, :], probs_TE, -1.0)
        expert_TK = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
        gate_TK = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for k in tl.static_range(K):
            best_T = tl.max(left_TE, axis=1)
            pick_T = tl.min(tl.where(left_TE == best_T[:, None], e_E[None, :], BLOCK_E), axis=1)
            expert_TK = tl.where(k_K[None, :] == k, pick_T[:, None], expert_TK)
            gate_TK = tl.where(k_K[None, :] == k, best_T[:, None], gate_TK)
            chosen_TE = e_E[None, :] == pick_T[:, None]
            left_TE = tl.where(chosen_TE, -2.0, left_TE)
            count_E = tl.sum((chosen_TE & valid_T[:, None]).to(tl.int32), axis=0)
            tl.store(hist_ptr + (k * B + b) * E + e_E, count_E, mask=valid_E)
        if NORMALIZE:
            gate_TK = gate_TK / tl.maximum(tl.sum(gate_TK, axis=1), 1.1754943508222875e-38)[:, None]
        mask_TK = valid_T[:, None] & (k_K < K)[None, :]
        tk_TK = t_T[:, None].to(tl.int64) * K + k_K[None, :]
        tl.store(expert_ptr + tk_TK, expert_TK.to(tl.int64), mask=mask_TK)
        tl.store(gate_ptr + tk_TK, gate_TK, mask=mask_TK)

    @triton.jit
    def _route_plan_kernel(hist_ptr, psum_ptr, zsum_ptr, first_ptr, load_ptr, kept_ptr, offs_ptr, aux_ptr,
                           aux_grad_ptr, aux_copy_ptr, E, B, A, counted_rows, cap, aux_scale, z_scale,
                           BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr):
        # one program: each expert's exclusive scan over the A = K * B histogram rows, a tile of BLOCK_A rows at a
        # time (a row at a time was A dependent steps: 6,144 at T 24,576, K 8)
        e_E = tl.arange(0, BLOCK_E)
        valid_E = e_E < E
        taken_E = tl.zeros([BLOCK_E], tl.int32)
        counted_E = tl.zeros([BLOCK_E], tl.int32)
        for begin in range(0, A, BLOCK_A):      # visiting order: choice k's blocks after those of every k' < k
            a_A = begin + tl.arange(0, BLOCK_A)
            mask_AE = (a_A < A)[:, None] & valid_E[None, :]
            at_AE = a_A[:, None].to(tl.int64) * E + e_E[None, :]
            hist_AE = tl.load(hist_ptr + at_AE, mask=mask_AE, other=0)
            tl.store(first_ptr + at_AE, taken_E[None, :] + tl.cumsum(hist_AE, 0) - hist_AE, mask=mask_AE)
            counted_E += tl.sum(tl.where((a_A < counted_rows)[:, None], hist_AE, 0), 0)
            taken_E += tl.sum(hist_AE, 0)
        kept_E = tl.minimum(taken_E, cap)
        tl.store(load_ptr + e_E, taken_E.to(tl.int64), mask=valid_E)
        tl.store(kept_ptr + e_E, kept_E.to(tl.int64), mask=valid_E)
        tl.store(offs_ptr + e_E, tl.cumsum(kept_E, 0), mask=valid_E)
        psum_E = tl.zeros([BLOCK_E], tl.float32)
        zsum = tl.zeros([], tl.float32)
        for begin in range(0, B, BLOCK_A):
            b_A = begin + tl.arange(0, BLOCK_A)
            mask_AE = (b_A < B)[:, None] & valid_E[None, :]
            psum_E += tl.sum(tl.load(psum_ptr + b_A[:, None].to(tl.int64) * E + e_E[None, :], mask=mask_AE, other=0), 0)
            zsum += tl.sum(tl.load(zsum_ptr + b_A, mask=b_A < B, other=0), 0)
        grad_E = aux_scale * counted_E.to(tl.float32)
        tl.store(aux_grad_ptr + e_E, grad_E, mask=valid_E)
        aux = tl.sum(psum_E * grad_E, axis=0) + z_scale * zsum
        tl.store(aux_ptr, aux)
        tl.store(aux_copy_ptr, aux)

    @triton.jit
    def _route_slots_kernel(expert_ptr, gate_ptr, first_ptr, kept_ptr, offs_ptr, pos_ptr, kept_out_ptr, final_ptr,
                            final_rows_ptr, T, E, B, cap,
                            scale, K: tl.constexpr, BLOCK_K: tl.constexpr, AFTER_DROP: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        b = tl.program_id(0)
        t_T = b * BLOCK_T + tl.arange(0, BLOCK_T)
        e_E = tl.arange(0, BLOCK_E)
        k_K = tl.arange(0, BLOCK_K)
        valid_T = t_T < T
        valid_E = e_E < E
        start_E = (tl.load(offs_ptr + e_E, mask=valid_E, other=0)
                   - tl.load(kept_ptr + e_E, mask=valid_E, other=0).to(tl.int32))
        kept_TK = tl.zeros([BLOCK_T, BLOCK_K], tl.int1)
        row_TK = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
        for k in tl.static_range(K):
            expert_T = tl.load(expert_ptr + t_T.to(tl.int64) * K + k, mask=valid_T, other=-1).to(tl.int32)
            mine_TE = ((expert_T[:, None] == e_E[None, :]) & valid_T[:, None]).to(tl.int32)
            rank_T = tl.sum(mine_TE * tl.cumsum(mine_TE, 0), axis=1) - 1      # earlier choices of it in the block
            first_E = tl.load(first_ptr + (k * B + b) * E + e_E, mask=valid_E, other=0)
            slot_T = tl.sum(mine_TE * first_E[None, :], axis=1) + rank_T
            kept_T = slot_T < cap
            row_T = tl.where(kept_T, tl.sum(mine_TE * start_E[None, :], axis=1) + slot_T, -1)
            tl.store(pos_ptr + t_T.to(tl.int64) * K + k, row_T.to(tl.int64), mask=valid_T)
            kept_TK = kept_TK | ((k_K[None, :] == k) & kept_T[:, None])
            if ROWS:
                row_TK = tl.where(k_K[None, :] == k, row_T[:, None].to(tl.int64), row_TK)
        mask_TK = valid_T[:, None] & (k_K < K)[None, :]
        tk_TK = t_T[:, None].to(tl.int64) * K + k_K[None, :]
        tl.store(kept_out_ptr + tk_TK, kept_TK, mask=mask_TK)
        gate_TK = tl.where(kept_TK, tl.load(gate_ptr + tk_TK, mask=mask_TK, other=0), 0.0)
        if AFTER_DROP:
            gate_TK = gate_TK / tl.maximum(tl.sum(gate_TK, axis=1), 1.1920928955078125e-07)[:, None]
        final_TK = (gate_TK * scale).to(final_ptr.dtype.element_ty)
        tl.store(final_ptr + tk_TK, final_TK, mask=mask_TK)
        if ROWS:
            tl.store(final_rows_ptr + row_TK, final_TK, mask=mask_TK & kept_TK)

    @triton.jit
    def _route_backward_kernel(grad_final_ptr, grad_aux_ptr, expert_ptr, gate_ptr, pos_ptr, probs_ptr, lse_ptr,
                               aux_grad_ptr, grad_ptr, T, E, scale, z_scale, K: tl.constexpr, BLOCK_K: tl.constexpr,
                               HAS_GRAD_GATE: tl.constexpr, BY_ROW: tl.constexpr, HAS_GRAD_AUX: tl.constexpr,
                               NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        b = tl.program_id(0)
        t_T = b * BLOCK_T + tl.arange(0, BLOCK_T)
        e_E = tl.arange(0, BLOCK_E)
        k_K = tl.arange(0, BLOCK_K)
        valid_T = t_T < T
        valid_E = e_E < E
        mask_TE = valid_T[:, None] & valid_E[None, :]
        probs_TE = tl.load(probs_ptr + t_T[:, None].to(tl.int64) * E + e_E[None, :], mask=mask_TE, other=0)
        grad_TE = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        if HAS_GRAD_GATE:
            mask_TK = valid_T[:, None] & (k_K < K)[None, :]
            tk_TK = t_T[:, None].to(tl.int64) * K + k_K[None, :]
            pos_TK = tl.load(pos_ptr + tk_TK, mask=mask_TK, other=-1)
            kept_TK = pos_TK >= 0
            if BY_ROW:
                up_TK = tl.load(grad_final_ptr + pos_TK, mask=mask_TK & kept_TK, other=0).to(tl.float32) * scale
            else:
                up_TK = tl.load(grad_final_ptr + tk_TK, mask=mask_TK, other=0).to(tl.float32) * scale
            g_TK = tl.load(gate_ptr + tk_TK, mask=mask_TK, other=0)       # the gates before dropping
            if NORMALIZE == 2:     # after_drop: f = h / max(sum h, eps), h = gate where kept
                h_TK = tl.where(kept_TK, g_TK, 0.0)
                total_T = tl.sum(h_TK, axis=1)
                n_T = tl.maximum(total_T, 1.1920928955078125e-07)
                inner_T = tl.where(total_T > 1.1920928955078125e-07, tl.sum(up_TK * h_TK, axis=1) / (n_T * n_T), 0.0)
                grad_g_TK = tl.where(kept_TK, up_TK / n_T[:, None] - inner_T[:, None], 0.0)
            else:
                grad_g_TK = tl.where(kept_TK, up_TK, 0.0)
            if NORMALIZE == 1:     # before_drop: g = p / sum p over the chosen
                p_TK = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
                for k in tl.static_range(K):
                    expert_T = tl.load(expert_ptr + t_T.to(tl.int64) * K + k, mask=valid_T, other=-1)
                    p_T = tl.sum(tl.where(e_E[None, :] == expert_T[:, None], probs_TE, 0.0), axis=1)
                    p_TK = tl.where(k_K[None, :] == k, p_T[:, None], p_TK)
                s_T = tl.maximum(tl.sum(p_TK, axis=1), 1.1754943508222875e-38)
                grad_g_TK = grad_g_TK / s_T[:, None] - (tl.sum(grad_g_TK * p_TK, axis=1) / (s_T * s_T))[:, None]
            for k in tl.static_range(K):
                expert_T = tl.load(expert_ptr + t_T.to(tl.int64) * K + k, mask=valid_T, other=-1)
                grad_T = tl.sum(tl.where(k_K[None, :] == k, grad_g_TK, 0.0), axis=1)
                grad_TE += tl.where(e_E[None, :] == expert_T[:, None], grad_T[:, None], 0.0)
        if HAS_GRAD_AUX:
            grad_aux = tl.load(grad_aux_ptr).to(tl.float32)
            grad_TE += grad_aux * tl.load(aux_grad_ptr + e_E, mask=valid_E, other=0)[None, :]
        grad_logits_TE = probs_TE * (grad_TE - tl.sum(probs_TE * grad_TE, axis=1)[:, None])
        if HAS_GRAD_AUX:
            if z_scale != 0:
                lse_T = tl.load(lse_ptr + t_T, mask=valid_T, other=0)
                grad_logits_TE += (grad_aux * z_scale * 2) * lse_T[:, None] * probs_TE
        tl.store(grad_ptr + t_T[:, None].to(tl.int64) * E + e_E[None, :],
                 grad_logits_TE.to(grad_ptr.dtype.element_ty), mask=mask_TE)
