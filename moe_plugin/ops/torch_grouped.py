"""The fused grouped-GEMM kernels' torch references (triton_grouped.py is tested against them): the up projection
reading the routed rows of x by index, with its bias and activation.

Legend: T tokens, D model dim, N hidden width (H), F the first projection's width (2N for gated activations:
[gate | up]), E experts, R routed rows (grouped by expert; rows past the last offset belong to no expert).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .grouped import grouped_mm_loop

# the activations the fused up projection takes in its epilogue
GATHER_UP_ACTIVATIONS = ("relu", "swiglu", "geglu")


def tokens_of_rows(pos_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """token_R[pos_TK[t, k]] = t for kept choices, 0 on rows no choice names (no host synchronization)."""
    T, K = pos_TK.shape
    token_R = torch.zeros(num_rows + 1, dtype=torch.int32, device=pos_TK.device)   # dropped ones: the spare row
    tokens_TK = torch.arange(T, dtype=torch.int32, device=pos_TK.device).unsqueeze(1).expand(T, K)
    token_R[pos_TK.masked_fill(pos_TK < 0, num_rows).reshape(-1)] = tokens_TK.reshape(-1)
    return token_R[:num_rows]


def gather_up(x_TD: torch.Tensor, token_R: torch.Tensor, offs_E: torch.Tensor, w1_EDF: torch.Tensor,
              b1_EF: Optional[torch.Tensor], activation: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(act_RN, saved): act(x_TD[token_R] W1[e] + b1[e]) for each expert's rows, and what the activation's backward
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
        act_RN = torch.relu(pre_RF).to(x_TD.dtype)
        return act_RN, act_RN
    N = pre_RF.shape[1] // 2
    gate_RN, up_RN = pre_RF[:, :N], pre_RF[:, N:]
    if activation == "swiglu":
        act_RN = torch.nn.functional.silu(gate_RN) * up_RN
    elif activation == "geglu":
        act_RN = torch.nn.functional.gelu(gate_RN) * up_RN
    else:
        raise ValueError(f"gather_up: activation {activation!r} is not fused; allowed: {GATHER_UP_ACTIVATIONS}")
    return act_RN.to(x_TD.dtype), pre_RF.to(x_TD.dtype)
