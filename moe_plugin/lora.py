"""LoRA on the experts of an MoELayer: a rank-Q adapter per expert on the first projection (gate+up) and the second
(down), computed on the routed rows as x W + s (x A) B with grouped GEMMs (experts.mlp_forward); W + s A B is
never formed, and the frozen base weights cost no gradient GEMM (experts.Needs).

    from moe_plugin.lora import add_lora, merge_lora, unmerge_lora
    add_lora(model, rank=16, alpha=32)      # every MoELayer in model; the experts' weights frozen
    ...train...
    merge_lora(model)                       # W += s A B (and unmerge_lora takes it back out)

Each rank holds the adapters of its own experts (expert parallelism); scale s = alpha / rank (PEFT's).

Legend: E experts on this rank, D model dim, H expert hidden dim (F = 2H columns for gated activations, else H),
Q LoRA rank.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .experts import NO_LORA, WEIGHT_NAMES, Experts
from .layer import MoELayer

TARGETS = ("up", "down")


class ExpertsLoRA(nn.Module):
    """The factors of one Experts module: up_a_EDQ [E, D, Q], up_b_EQF [E, Q, F] (target "up"), down_a_EHQ [E, H, Q],
    down_b_EQD [E, Q, D] (target "down"); None for a projection not targeted. A is drawn as PEFT draws its lora_A
    (uniform in +-1/sqrt(in features)), B is zero: a new adapter changes nothing until it trains."""

    def __init__(self, experts: Experts, rank: int, alpha: float, targets: Sequence[str]):
        super().__init__()
        E, D, F = experts.w1_EDH.shape
        H = experts.w2_EHD.shape[1]
        self.rank, self.alpha, self.targets, self.merged = rank, float(alpha), tuple(targets), False
        like = dict(dtype=experts.w1_EDH.dtype, device=experts.w1_EDH.device)
        up, down = "up" in targets, "down" in targets
        self.up_a_EDQ = nn.Parameter(torch.empty(E, D, rank, **like)) if up else None
        self.up_b_EQF = nn.Parameter(torch.empty(E, rank, F, **like)) if up else None
        self.down_a_EHQ = nn.Parameter(torch.empty(E, H, rank, **like)) if down else None
        self.down_b_EQD = nn.Parameter(torch.empty(E, rank, D, **like)) if down else None
        self.reset_parameters()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for a, b in self.pairs():
                if a is not None and not a.is_meta:
                    bound = 1.0 / math.sqrt(a.shape[1])
                    a.uniform_(-bound, bound)
                    b.zero_()

    def pairs(self):
        return (self.up_a_EDQ, self.up_b_EQF), (self.down_a_EHQ, self.down_b_EQD)

    def factors(self) -> tuple:
        """(up_a_EDQ, s * up_b_EQF, down_a_EHQ, s * down_b_EQD), what experts.mlp_forward takes; all None when merged."""
        if self.merged:
            return NO_LORA
        out = []
        for a, b in self.pairs():
            out += [a, None if b is None else b * self.scale]
        return tuple(out)

    @torch.no_grad()
    def delta(self, pair: int) -> Optional[torch.Tensor]:
        """s A B of pair 0 (up: [E, D, F]) or 1 (down: [E, H, D]), in fp32 or wider; None when not targeted."""
        a, b = self.pairs()[pair]
        if a is None:
            return None
        dtype = torch.promote_types(a.dtype, torch.float32)
        return torch.bmm(a.to(dtype), b.to(dtype)) * self.scale

    @torch.no_grad()
    def fold(self, experts: Experts, sign: int) -> None:
        for pair, weight in enumerate((experts.w1_EDH, experts.w2_EHD)):
            delta = self.delta(pair)
            if delta is not None:
                weight.copy_((weight.to(delta.dtype) + sign * delta).to(weight.dtype))

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, targets={self.targets}, merged={self.merged}"


def moe_layers(model: nn.Module) -> List[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def add_lora(model: nn.Module, rank: int, alpha: Optional[float] = None, targets: Iterable[str] = TARGETS
             ) -> List[ExpertsLoRA]:
    """Adds a LoRA adapter (rank, alpha: scale alpha / rank, default alpha = rank) to the experts of every MoELayer in
    model (model itself may be one), on the projections in targets ("up": the first, gate+up; "down": the second),
    and freezes the experts' weights and biases. Returns the adapters (also at layer.experts.lora)."""
    targets = tuple(targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"add_lora: targets={targets!r} names nothing the experts have: allowed are {TARGETS} "
                         f"(one or both)")
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"add_lora: {type(model).__name__} holds no MoELayer: nothing to adapt")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"add_lora: rank must be a positive int, got {rank!r}")
    alpha = float(rank if alpha is None else alpha)
    adapters = []
    for layer in layers:
        experts = layer.experts
        if not experts.stacked:
            raise TypeError(f"add_lora: LoRA inside the layer adapts its stacked experts only, not expert modules "
                            f"({experts.module_name}); adapt those modules' own weights (PEFT target_modules)")
        if experts.slices > 1:
            raise ValueError(f"add_lora: experts sliced along the hidden dim ({experts.slices} slices, ep_size > "
                             f"num_experts) cannot hold adapters; use ep_size <= num_experts")
        limit = min(experts.w1_EDH.shape[1], experts.w2_EHD.shape[1])
        if rank > limit:
            raise ValueError(f"add_lora: rank={rank} is larger than the experts' dims (model_dim "
                             f"{experts.w1_EDH.shape[1]}, hidden_size {experts.w2_EHD.shape[1]}): at most {limit}")
        if getattr(experts, "lora", None) is not None:
            raise ValueError("add_lora: these experts hold an adapter already (remove it: remove_lora)")
        experts.lora = ExpertsLoRA(experts, rank, alpha, targets)
        for name in WEIGHT_NAMES:
            param = getattr(experts, name)
            if param is not None:
                param.requires_grad_(False)
        adapters.append(experts.lora)
    return adapters


def whole_lora(layer: MoELayer) -> Dict[str, torch.Tensor]:
    """{"lora.<factor>": the factor with every expert, detached} for an adapted layer ({} without an adapter): the
    ranks' factors gathered over the layer's expert-parallel group (a collective there; FSDP2 shards gathered first)."""
    lora = getattr(layer.experts, "lora", None)
    if lora is None:
        return {}
    from torch.distributed.tensor import DTensor
    out = {}
    for name, param in lora.named_parameters():
        factor = (param.full_tensor() if isinstance(param, DTensor) else param).detach().contiguous()
        if layer.is_parallel:
            group = layer.groups.ep_group
            parts = [torch.empty_like(factor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, factor, group=group)
            factor = torch.cat(parts)
        out[f"lora.{name}"] = factor
    return out


def _adapters(model: nn.Module):
    pairs = [(layer.experts, getattr(layer.experts, "lora", None)) for layer in moe_layers(model)]
    pairs = [(experts, lora) for experts, lora in pairs if lora is not None]
    if not pairs:
        raise ValueError(f"{type(model).__name__} holds no MoELayer with a LoRA adapter (add_lora first)")
    return pairs


def merge_lora(model: nn.Module) -> None:
    """W += s A B in every adapted layer; the adapters then compute nothing until unmerge_lora."""
    for experts, lora in _adapters(model):
        if not lora.merged:
            lora.fold(experts, +1)
            lora.merged = True


def unmerge_lora(model: nn.Module) -> None:
    """W -= s A B: undoes merge_lora."""
    for experts, lora in _adapters(model):
        if lora.merged:
            lora.fold(experts, -1)
            lora.merged = False


def remove_lora(model: nn.Module, merge: bool = False) -> None:
    """Drops the adapters (merged into the weights first when merge), leaving plain experts."""
    for experts, lora in _adapters(model):
        if merge and not lora.merged:
            lora.fold(experts, +1)
        elif not merge and lora.merged:
            lora.fold(experts, -1)
        del experts.lora
