"""The experts' weights across an expert-parallel group: the weights a rank computes with at parallel degree r
(gathered_experts; the dispatcher, dispatchers/all_to_all.py, calls it), and every expert whole (whole_experts,
for checkpoints and exports).

r = 0: every rank gathers all experts' weights. r >= 1: a compute slice of an expert is the concatenated hidden
slices of the V = slices / r ranks of its gather group (slices: hidden slices per expert).

Shape legend: moe_plugin/__init__.py (here V ranks gathered per compute slice).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..activations import as_activation
from ..experts import WEIGHT_NAMES, ExpertWeights, lora_factors
from .all_to_all import gather_sum
from .groups import ExpertGroups


def gathered_experts(experts, groups: ExpertGroups, r: int) -> ExpertWeights:
    """The weights (an ExpertWeights, or anything with its fields) this rank computes with under degree r
    (gathered where needed; differentiable)."""
    layout = groups.layout
    group = groups.gather_groups[r]
    use_b2 = layout.computes_first_slice(r) if r else True
    recompute = getattr(experts, "recompute", False)      # a field with a default: holders of the others may lack it
    if r == layout.slices:
        return ExpertWeights(experts.w1_EDH, experts.b1_EH, experts.w2_EHD, experts.b2_ED if use_b2 else None,
                             experts.activation, lora_factors(experts), recompute)
    V = dist.get_world_size(group)
    experts_in = max(1, V // layout.slices) if layout.slices > 1 else V * layout.local_experts
    slices_in = V // experts_in if layout.slices > 1 else 1
    gated = as_activation(experts.activation).gated

    def join(tensor, hidden_dim):
        """[V, E_local, ...] gathered -> [experts_in, ...] with the hidden slices concatenated."""
        if tensor is None:
            return None
        gathered = gather_sum(tensor, group)
        if layout.slices == 1:
            return gathered.flatten(0, 1)
        gathered = gathered.view((experts_in, slices_in) + tuple(tensor.shape[1:]))
        if hidden_dim is None:            # b2: the first slice owns it
            return gathered[:, 0]
        parts = gathered.unbind(1)
        if gated and hidden_dim == -1:
            gates, ups = zip(*(p.chunk(2, dim=-1) for p in parts))
            return torch.cat(list(gates) + list(ups), dim=-1)
        return torch.cat(parts, dim=hidden_dim)

    lora = lora_factors(experts)     # LoRA factors come with whole experts only (lora.py refuses hidden slices)
    return ExpertWeights(join(experts.w1_EDH, -1), join(experts.b1_EH, -1), join(experts.w2_EHD, 1),
                         join(experts.b2_ED, None) if use_b2 else None, experts.activation,
                         tuple(None if f is None else join(f, 1) for f in lora), recompute)


@torch.no_grad()
def whole_experts(layer) -> dict:
    """The stacked expert tensors of an expert-parallel layer with every expert, whole, detached (collectives over
    its FSDP2 mesh, where sharded, and its expert-parallel group): name -> tensor, for w1_EDH, b1_EH, ..."""
    from torch.distributed.tensor import DTensor
    local = [getattr(layer.experts, name, None) for name in WEIGHT_NAMES]
    local = [t.full_tensor() if isinstance(t, DTensor) else t for t in local]
    whole = gathered_experts(ExpertWeights(*local, layer.experts.activation), layer.groups, 0)
    return {name: t.detach() for name, t in zip(WEIGHT_NAMES, whole) if t is not None}
