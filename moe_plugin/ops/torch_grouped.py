"""The fused grouped-GEMM kernels' torch references (triton_grouped.py is tested against them): the up projection
reading the routed rows of x by index, with its bias and activation; the down projection's dgrad with SwiGLU's
backward; the first projection's weight gradient reading x's rows by index, with the bias gradient.

Shape legend: moe_plugin/__init__.py (T tokens, D model dim, H hidden width, F the first projection's width: 2H
for gated activations, [gate | up]; E experts, R routed rows grouped by expert, rows past the last offset
belonging to no expert); RH2 is [R, 2H].
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

# the activations the fused up projection takes in its epilogue
GATHER_UP_ACTIVATIONS = ("relu", "swiglu", "geglu")


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """The per-expert torch.mm loop (the reference; fp64). Reads the offsets on the host."""
    ends = offs_E.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e, (start, end) in enumerate(zip(starts, ends)):
            if end > start:
                torch.mm(a[start:end], b[e], out=out[start:end])
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
    for e, (start, end) in enumerate(zip(starts, ends)):
        if end > start:
            torch.mm(a[:, start:end], b[start:end], out=out[e])
    return out


def tokens_of_rows(pos_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """token_R[pos_TK[t, k]] = t for kept choices, 0 on rows no choice names (no host synchronization)."""
    T, K = pos_TK.shape
    token_R = torch.zeros(num_rows + 1, dtype=torch.int32, device=pos_TK.device)   # dropped ones: the spare row
    tokens_TK = torch.arange(T, dtype=torch.int32, device=pos_TK.device).unsqueeze(1).expand(T, K)
    token_R[pos_TK.masked_fill(pos_TK < 0, num_rows).reshape(-1)] = tokens_TK.reshape(-1)
    return token_R[:num_rows]


def gather_up(x_TD: torch.Tensor, token_R: torch.Tensor, offs_E: torch.Tensor, w1_EDF: torch.Tensor,
              b1_EF: Optional[torch.Tensor], activation: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(act_RH, saved): act(x_TD[token_R] W1[e] + b1[e]) for each expert's rows, and what the activation's backward
    keeps (activations.activate: relu its output, the others the pre-activation [R, F]); rows past the last
    offset are 0. Computed in fp32 or wider, rounded once to x's dtype."""
    wide = torch.promote_types(x_TD.dtype, torch.float32)
    if x_TD.shape[0] == 0:     # no tokens: every row is past the last offset
        x_RD = x_TD.new_zeros(token_R.shape[0], x_TD.shape[1], dtype=wide)
    else:
        x_RD = x_TD.to(wide).index_select(0, token_R.long())
    pre_RF = grouped_mm_loop(x_RD, w1_EDF.to(wide), offs_E)
    if b1_EF is not None:
        start = 0
        for e, end in enumerate(offs_E.tolist()):
            pre_RF[start:end] += b1_EF[e].to(wide)
            start = end
    if activation == "relu":
        act_RH = torch.relu(pre_RF).to(x_TD.dtype)
        return act_RH, act_RH
    H = pre_RF.shape[1] // 2
    gate_RH, up_RH = pre_RF[:, :H], pre_RF[:, H:]
    if activation == "swiglu":
        act_RH = torch.nn.functional.silu(gate_RH) * up_RH
    elif activation == "geglu":
        act_RH = torch.nn.functional.gelu(gate_RH) * up_RH
    else:
        raise ValueError(f"gather_up: activation {activation!r} is not fused; allowed: {GATHER_UP_ACTIVATIONS}")
    return act_RH.to(x_TD.dtype), pre_RF.to(x_TD.dtype)


def dgrad_swiglu(grad_RD: torch.Tensor, offs_E: torch.Tensor, w2_EHD: torch.Tensor, pre_RH2: torch.Tensor,
                 scale_R1: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale * grad of the pre-activation [R, 2H], the activations [R, H], dot_R [R]) of the down projection's
    dgrad grad_act = grad_RD W2[e]^T followed by SwiGLU's backward: dot_R = <grad_act[r], act[r]> is the gate
    gradient of row r when grad_RD is its unscaled output gradient (experts.mlp_backward). Rows past the last
    offset: 0. Computed in fp32 or wider; dot_R stays wide, the rest is rounded to grad's dtype."""
    wide = torch.promote_types(grad_RD.dtype, torch.float32)
    grad_act_RH = grouped_mm_loop(grad_RD.to(wide), w2_EHD.to(wide).transpose(1, 2), offs_E)
    H = grad_act_RH.shape[1]
    gate_RH, up_RH = pre_RH2.to(wide)[:, :H], pre_RH2.to(wide)[:, H:]
    silu_RH = torch.nn.functional.silu(gate_RH)
    act_RH = silu_RH * up_RH
    sig_RH = torch.sigmoid(gate_RH)
    grad_gate_RH = grad_act_RH * up_RH * (sig_RH + gate_RH * sig_RH * (1 - sig_RH))
    grad_pre_RH2 = torch.cat([grad_gate_RH, grad_act_RH * silu_RH], dim=1) * scale_R1.to(wide)
    kept_R1 = (torch.arange(grad_RD.shape[0], device=grad_RD.device) < offs_E[-1]).unsqueeze(1) if offs_E.numel() \
        else torch.zeros(grad_RD.shape[0], 1, dtype=torch.bool, device=grad_RD.device)
    act_RH, grad_pre_RH2 = act_RH * kept_R1, grad_pre_RH2 * kept_R1
    return grad_pre_RH2.to(grad_RD.dtype), act_RH.to(grad_RD.dtype), (grad_act_RH * act_RH).sum(1)


def wgrad_gather(x_TD: torch.Tensor, token_R: torch.Tensor, offs_E: torch.Tensor, grad_RF: torch.Tensor,
                 bias: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(grad_w1_EDF, grad_b1_EF or None): the first projection's weight gradient x_TD[token_R][rows of e]^T
    grad_RF[rows of e] for each expert e (0 for an empty one) and, with bias, the column sums of each expert's rows
    of grad_RF; rows past the last offset are not read. Computed in fp32 or wider, rounded to grad's dtype."""
    wide = torch.promote_types(grad_RF.dtype, torch.float32)
    if x_TD.shape[0] == 0:     # no tokens: every expert is empty
        x_RD = x_TD.new_zeros(token_R.shape[0], x_TD.shape[1], dtype=wide)
    else:
        x_RD = x_TD.to(wide).index_select(0, token_R.long())
    wide_RF = grad_RF.to(wide)
    grad_w_EDF = grouped_mm_loop(x_RD.t(), wide_RF, offs_E)
    if not bias:
        return grad_w_EDF.to(grad_RF.dtype), None
    grad_b_EF, start = wide_RF.new_zeros(offs_E.shape[0], grad_RF.shape[1]), 0
    for e, end in enumerate(offs_E.tolist()):
        grad_b_EF[e] = wide_RF[start:end].sum(0)
        start = end
    return grad_w_EDF.to(grad_RF.dtype), grad_b_EF.to(grad_RF.dtype)
