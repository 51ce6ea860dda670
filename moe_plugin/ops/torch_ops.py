"""The routing kernels in plain torch: the reference every native and GPU kernel is tested against,
and the path taken when no native kernel is available.

Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, E experts, K top-k, R routed rows (kept choices,
grouped by expert), A the T*K choices, choice-major).
pos_TK[t, k] is the routed row of token t's k-th choice, -1 where the choice was dropped; every
kept row is the position of exactly one kept choice. R may exceed the kept rows (the layer sizes
its rows statically, T*K): the rows no choice names come last, and their contents are unspecified.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def route_slots(expert_TK: torch.Tensor, order_T: Optional[torch.Tensor], row_start_E: torch.Tensor,
                capacity: int, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Give each choice its slot in its expert, visiting choices choice-major (all first choices, then
    all second ones), tokens in order_T order (0..T-1 when None). A choice whose slot is below
    capacity gets row row_start_E[e] + slot; the rest are dropped (-1).

    Returns pos_TK [T, K] and token_R [num_rows], the token of each row.
    """
    T, K = expert_TK.shape
    device = expert_TK.device
    order_T = torch.arange(T, device=device) if order_T is None else order_T
    expert_A = expert_TK.index_select(0, order_T).t().reshape(-1)
    token_A = order_T.repeat(K)
    choice_A = torch.arange(K, device=device).repeat_interleave(T)
    expert_sorted_A, sorted_A = torch.sort(expert_A, stable=True)     # slot_A, kept_A, row_A: in this order
    load_E = torch.bincount(expert_A, minlength=row_start_E.shape[0])
    slot_A = torch.arange(expert_sorted_A.shape[0], device=device) - (load_E.cumsum(0) - load_E)[expert_sorted_A]
    kept_A = slot_A < capacity
    row_A = torch.where(kept_A, row_start_E[expert_sorted_A] + slot_A, -1)
    pos_TK = torch.empty(T, K, dtype=torch.long, device=device)
    pos_TK[token_A[sorted_A], choice_A[sorted_A]] = row_A
    token_R = torch.empty(num_rows, dtype=torch.long, device=device)
    token_R[row_A[kept_A]] = token_A[sorted_A[kept_A]]
    return pos_TK, token_R


def scatter_rows(src_TD: torch.Tensor, pos_TK: torch.Tensor, scale_TK: Optional[torch.Tensor],
                 other_RD: Optional[torch.Tensor], num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """out_RD[pos_TK[t, k]] = scale_TK[t, k] * src_TD[t] (scale 1 when None);
    dot_TK[t, k] = <src_TD[t], other_RD[pos_TK[t, k]]>, 0 for dropped choices ([0] when other_RD is None).
    """
    rows_RD = src_TD.index_select(0, tokens_of_rows(pos_TK, num_rows))
    dot_TK = src_TD.new_empty(0)
    if other_RD is not None:
        dot_TK = rows_to_choices(row_dot(rows_RD, other_RD), pos_TK)
    if scale_TK is not None:
        rows_RD.mul_(choices_to_rows(scale_TK, pos_TK, num_rows)[:, None])
    return rows_RD, dot_TK


def gather_sum(src_RD: torch.Tensor, pos_TK: torch.Tensor, scale_TK: Optional[torch.Tensor],
               other_TD: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """out_TD[t] = sum over kept k of scale_TK[t, k] * src_RD[pos_TK[t, k]] (scale 1 when None);
    dot_TK[t, k] = <other_TD[t], src_RD[pos_TK[t, k]]>, 0 for dropped choices ([0] when other_TD is None).
    """
    kept_TK = pos_TK >= 0
    weight_TK = kept_TK.to(src_RD.dtype)
    if scale_TK is not None:
        weight_TK = weight_TK * scale_TK
    out_TD = combine_rows(src_RD, weight_TK, pos_TK)
    dot_TK = src_RD.new_empty(0)
    if other_TD is not None:
        token_R = tokens_of_rows(pos_TK, src_RD.shape[0])
        dot_TK = rows_to_choices(row_dot(other_TD.index_select(0, token_R), src_RD), pos_TK)
    return out_TD, dot_TK


def tokens_of_rows(pos_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """token_R[pos_TK[t, k]] = t for every kept choice; 0 for rows no choice names (the rows past
    the kept ones when the routed rows have a static T*K size)."""
    kept_TK = pos_TK >= 0
    token_R = torch.zeros(num_rows, dtype=torch.long, device=pos_TK.device)
    token_R[pos_TK[kept_TK]] = torch.nonzero(kept_TK)[:, 0]
    return token_R


def choices_to_rows(values_TK: torch.Tensor, pos_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """values_R[pos_TK[t, k]] = values_TK[t, k] for every kept choice."""
    kept_TK = pos_TK >= 0
    values_R = values_TK.new_zeros(num_rows)
    values_R[pos_TK[kept_TK]] = values_TK[kept_TK]
    return values_R


def rows_to_choices(values_R: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """values_TK[t, k] = values_R[pos_TK[t, k]] for kept choices, 0 for dropped ones."""
    kept_TK = pos_TK >= 0
    values_TK = values_R.new_zeros(pos_TK.shape)
    values_TK[kept_TK] = values_R[pos_TK[kept_TK]]
    return values_TK


def _chunk_rows(tensor: torch.Tensor) -> int:
    """Rows per chunk so that a [chunk, D] scratch stays in cache (about 512 KiB)."""
    return max(16, (1 << 19) // max(1, tensor.shape[1] * tensor.element_size()))


def combine_rows(y_RD: torch.Tensor, weight_TK: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k weight_TK[t, k] * y_RD[pos_TK[t, k]]; dropped choices carry weight 0."""
    T, K = pos_TK.shape
    if y_RD.shape[0] == 0:
        return y_RD.new_zeros(T, y_RD.shape[1])
    safe_pos_TK = pos_TK.clamp(min=0)
    y_TD = y_RD.index_select(0, safe_pos_TK[:, 0]).mul_(weight_TK[:, :1])
    if K == 1:
        return y_TD
    # choices after the first go through a small reused scratch: no second [T, D] buffer
    chunk = _chunk_rows(y_RD)
    scratch_TD = y_RD.new_empty(chunk, y_RD.shape[1])
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        rows_TD = scratch_TD[:end - start]
        for k in range(1, K):
            torch.index_select(y_RD, 0, safe_pos_TK[start:end, k], out=rows_TD)
            y_TD[start:end].addcmul_(rows_TD, weight_TK[start:end, k:k + 1])
    return y_TD


def row_dot(a_RD: torch.Tensor, b_RD: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """dot_R[r] = <a_RD[r], b_RD[r]>, in cache-sized chunks; with dtype, the products and sums in dtype (exact
    products of bf16 rows in fp32) and dot_R in dtype."""
    dtype = a_RD.dtype if dtype is None else dtype
    dot_R = a_RD.new_empty(a_RD.shape[0], dtype=dtype)
    chunk = _chunk_rows(a_RD)
    scratch_RD = a_RD.new_empty(min(chunk, a_RD.shape[0]), a_RD.shape[1], dtype=dtype)
    for start in range(0, a_RD.shape[0], chunk):
        end = min(start + chunk, a_RD.shape[0])
        product_RD = scratch_RD[:end - start].copy_(a_RD[start:end]).mul_(b_RD[start:end])
        torch.sum(product_RD, dim=1, out=dot_R[start:end])
    return dot_R


def swiglu_forward(pre_RH2: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up] [R, 2H] -> [R, H]."""
    gate_RH, up_RH = pre_RH2.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate_RH) * up_RH


def swiglu_backward(grad_RH: torch.Tensor, pre_RH2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad of pre [R, 2H], the activations [R, H]) from the activations' gradient and pre."""
    gate_RH, up_RH = pre_RH2.chunk(2, dim=-1)
    silu_RH = torch.nn.functional.silu(gate_RH)
    grad_gate_RH = torch.ops.aten.silu_backward(grad_RH * up_RH, gate_RH)
    return torch.cat([grad_gate_RH, grad_RH * silu_RH], dim=-1), silu_RH * up_RH


def clamped_swiglu_forward(pre_RH2: torch.Tensor, limit: float, alpha: float, beta: float) -> torch.Tensor:
    """(clamp(up, -L, L) + beta) * g * sigmoid(alpha * g) with g = min(gate, L), of rows [gate | up] [R, 2H] -> [R, H]
    (SwiGLU clamped at L: alpha 1, beta 0; gpt-oss: beta 1)."""
    gate_RH, up_RH = pre_RH2.chunk(2, dim=-1)
    gate_RH, up_RH = gate_RH.clamp(max=limit), up_RH.clamp(-limit, limit)
    return (up_RH + beta) * gate_RH * torch.sigmoid(alpha * gate_RH)


def clamped_swiglu_backward(grad_RH: torch.Tensor, pre_RH2: torch.Tensor, limit: float, alpha: float, beta: float
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad of pre [R, 2H], the activations [R, H]) of clamped_swiglu_forward; a clamp passes the gradient
    where its input lies inside its bounds, bounds included (as torch.clamp)."""
    gate_RH, up_RH = pre_RH2.chunk(2, dim=-1)
    g_RH, u_RH = gate_RH.clamp(max=limit), up_RH.clamp(-limit, limit)
    sig_RH = torch.sigmoid(alpha * g_RH)
    glu_RH = g_RH * sig_RH
    zero = grad_RH.new_zeros(())
    grad_gate_RH = torch.where(gate_RH <= limit, grad_RH * (u_RH + beta) * (sig_RH + alpha * glu_RH * (1 - sig_RH)), zero)
    grad_up_RH = torch.where((up_RH >= -limit) & (up_RH <= limit), grad_RH * glu_RH, zero)
    return torch.cat([grad_gate_RH, grad_up_RH], dim=-1), (u_RH + beta) * glu_RH


def swiglu_backward_(grad_RH: torch.Tensor, pre_RH2: torch.Tensor, act_RH: torch.Tensor) -> None:
    """swiglu_backward in place: pre_RH2 becomes the gradient of pre, act_RH (which may be grad_RH) the activations."""
    grad_pre_RH2, out_RH = swiglu_backward(grad_RH, pre_RH2)
    pre_RH2.copy_(grad_pre_RH2)
    act_RH.copy_(out_RH)


def clamped_swiglu_backward_(grad_RH: torch.Tensor, pre_RH2: torch.Tensor, act_RH: torch.Tensor, limit: float,
                             alpha: float, beta: float) -> None:
    """clamped_swiglu_backward in place, as swiglu_backward_."""
    grad_pre_RH2, out_RH = clamped_swiglu_backward(grad_RH, pre_RH2, limit, alpha, beta)
    pre_RH2.copy_(grad_pre_RH2)
    act_RH.copy_(out_RH)
