"""Tutel's experts on our layer.

The fast path: ffn with a known activation and both biases or none, and llama_ffn with SiLU (or GELU), are our stacked
Experts (w1_EDH = batched_fc1_w transposed, or [W_fc1 | W_fc2] for llama_ffn's gated SiLU; w2_EHD = batched_fc2_w or
W_fc3). init_like_tutel draws them as Tutel would from the same random state.

The general path: any other activation callable, one bias without the other, and custom expert modules run as Tutel
runs them, on all of a process's experts at once (x [E_local, C, D], ctx: the layer), from CustomExperts, which puts
the routed rows into that padded layout and back. FFNExperts and LlamaExperts hold Tutel's parameters under Tutel's
names for the general path.

Shape legend: moe_plugin/__init__.py (here R routed rows grouped by expert, D model dim, H expert hidden dim, E experts,
C rows per expert in the padded layout).
"""
from __future__ import annotations

from typing import List, Mapping

import torch
from torch import nn

from ..experts import BaseExperts
from .arguments import ExpertSpec


@torch.no_grad()
def init_like_tutel(experts, spec: ExpertSpec, model_dim: int) -> None:
    """Our stacked experts (w1_EDH, b1_EH, w2_EHD, b2_ED) with the values Tutel's would draw."""
    E, D, H = spec.num_local, model_dim, spec.hidden
    if spec.kind == "llama_ffn":
        fc1_EDH, fc2_EDH, fc3_EHD = _llama_draws(E, D, H)
        experts.w1_EDH.copy_(torch.cat([fc1_EDH, fc2_EDH], dim=2))
        experts.w2_EHD.copy_(fc3_EHD)
        return
    for e, (fc1, fc2) in enumerate(_ffn_draws(E, D, H, spec.fc1_bias, spec.fc2_bias)):
        experts.w1_EDH[e].copy_(fc1.weight.t())
        experts.w2_EHD[e].copy_(fc2.weight.t())
        if spec.fc1_bias:
            experts.b1_EH[e].copy_(fc1.bias)
            experts.b2_ED[e].copy_(fc2.bias)


def _ffn_draws(E: int, D: int, H: int, fc1_bias: bool, fc2_bias: bool) -> List[tuple]:
    """Each expert's two Linears, drawn in Tutel's order (fc1 then fc2, expert by expert)."""
    return [(nn.Linear(D, H, bias=fc1_bias), nn.Linear(H, D, bias=fc2_bias)) for _ in range(E)]


def _llama_draws(E: int, D: int, H: int):
    return (torch.empty(E * D * H).normal_(0, 0.01).view(E, D, H), torch.empty(E * D * H).normal_(0, 0.01).view(E, D, H),
            torch.empty(E * H * D).normal_(0, 0.01).view(E, H, D))


class FFNExperts(nn.Module):
    """Tutel's ffn experts for the general path: act(x @ fc1^T + b1) @ fc2 + b2, act any callable."""

    def __init__(self, spec: ExpertSpec, model_dim: int):
        super().__init__()
        E, D, H = spec.num_local, model_dim, spec.hidden
        self.activation_fn, self.with_self = spec.activation_fn, spec.with_self
        self.batched_fc1_w = nn.Parameter(torch.empty(E, H, D))
        self.batched_fc2_w = nn.Parameter(torch.empty(E, H, D))
        self.batched_fc1_bias = nn.Parameter(torch.empty(E, H)) if spec.fc1_bias else None
        self.batched_fc2_bias = nn.Parameter(torch.empty(E, D)) if spec.fc2_bias else None
        with torch.no_grad():
            for e, (fc1, fc2) in enumerate(_ffn_draws(E, D, H, spec.fc1_bias, spec.fc2_bias)):
                self.batched_fc1_w[e].copy_(fc1.weight)
                self.batched_fc2_w[e].copy_(fc2.weight.t())
                if spec.fc1_bias:
                    self.batched_fc1_bias[e].copy_(fc1.bias)
                if spec.fc2_bias:
                    self.batched_fc2_bias[e].copy_(fc2.bias)

    def forward(self, x_ECD: torch.Tensor, ctx=None) -> torch.Tensor:
        h_ECH = torch.matmul(x_ECD, self.batched_fc1_w.transpose(1, 2))
        if self.batched_fc1_bias is not None:
            h_ECH = h_ECH + self.batched_fc1_bias.unsqueeze(1)
        h_ECH = self.activation_fn(h_ECH, self) if self.with_self else self.activation_fn(h_ECH)
        y_ECD = torch.matmul(h_ECH, self.batched_fc2_w)
        return y_ECD if self.batched_fc2_bias is None else y_ECD + self.batched_fc2_bias.unsqueeze(1)


class LlamaExperts(nn.Module):
    """Tutel's llama_ffn experts for the general path (an activation other than SiLU and GELU): act(x @ W_fc1) *
    (x @ W_fc2) @ W_fc3, the weights flat as Tutel keeps them."""

    def __init__(self, spec: ExpertSpec, model_dim: int):
        super().__init__()
        E, D, H = spec.num_local, model_dim, spec.hidden
        self.shapes = ((E, D, H), (E, D, H), (E, H, D))
        self.activation_fn = spec.activation_fn
        fc1, fc2, fc3 = _llama_draws(E, D, H)
        self.W_fc1, self.W_fc2, self.W_fc3 = (nn.Parameter(w.reshape(-1).clone()) for w in (fc1, fc2, fc3))

    def forward(self, x_ECD: torch.Tensor, ctx=None) -> torch.Tensor:
        fc1_EDH, fc2_EDH, fc3_EHD = (w.view(shape) for w, shape in zip((self.W_fc1, self.W_fc2, self.W_fc3),
                                                                         self.shapes))
        return torch.matmul(self.activation_fn(torch.matmul(x_ECD, fc1_EDH)) * torch.matmul(x_ECD, fc2_EDH), fc3_EHD)


class CustomExperts(BaseExperts):
    """Experts that run as one module on all of this process's experts: module(x [E_local, C, D], ctx) -> y [E_local,
    C, D] (Tutel's experts contract); C is the largest count of rows an expert got, the rest of its block zeros.
    ctx: the Tutel layer (custom modules read ctx.num_global_experts, ctx.sharded_count, ...). The state dict holds
    the module's own names under experts.module."""

    def __init__(self, module: nn.Module, num_local: int):
        super().__init__()
        self.module, self.num_local = module, num_local
        self.__dict__["ctx"] = None       # the layer, set by it: not a submodule

    def parallel_degrees(self, layout) -> list:
        return [1]

    def check_degree(self, layout, r: int) -> None:
        if r != 1:
            raise ValueError(f"parallel degree {r} is not supported with Tutel's general-path experts (a custom "
                             f"module or activation): they run expert parallel only, parallel_type 'adaptive:1'")
        layout.check_degree(r)

    def forward(self, x_RD: torch.Tensor, rows_per_expert) -> torch.Tensor:
        rows = rows_per_expert.tolist() if torch.is_tensor(rows_per_expert) else list(rows_per_expert)
        C, D = max(rows, default=0), x_RD.shape[1]
        starts = [sum(rows[:e]) for e in range(len(rows))]
        x_ECD = x_RD.new_zeros(len(rows), C, D)
        for e, (start, count) in enumerate(zip(starts, rows)):
            x_ECD[e, :count] = x_RD[start:start + count]
        y_ECD = self.module(x_ECD, self.ctx)
        if not torch.is_tensor(y_ECD) or tuple(y_ECD.shape) != (len(rows), C, D):
            got = tuple(y_ECD.shape) if torch.is_tensor(y_ECD) else type(y_ECD).__name__
            raise ValueError(f"Tutel expert module {type(self.module).__name__} must map x [E_local, C, D] = "
                             f"{[len(rows), C, D]} to the same shape, gave {got}")
        y_RD = torch.cat([y_ECD[e, :count] for e, count in enumerate(rows)] if rows else [x_RD[:0]])
        tail = x_RD.shape[0] - y_RD.shape[0]
        return torch.cat([y_RD.to(x_RD.dtype), x_RD.new_zeros(tail, D)]) if tail else y_RD.to(x_RD.dtype)

    def local_share(self, state: Mapping[str, torch.Tensor], prefix: str = "experts.") -> dict:
        raise ValueError("Tutel's general-path experts hold one process's experts in the module's own layout: load "
                         "each process's state dict (load_state_dict), not a full one")
