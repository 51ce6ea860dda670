"""Which ranks of a world hold the same amount: a role is a set of ranks whose parameter, gradient and optimizer
bytes are equal, so that one of them (built under the fake process group) stands for all.

Under DDP every rank holds the same dense tensors and an equal share of the experts: one role. Under FSDP2
(parallel/fsdp.py) a rank holds chunk i of each tensor as torch.chunk cuts it: dense tensors along dim 0 over all
ranks (i = rank), expert tensors over the ranks holding the same experts (i = rank // ep_size), along dim 0, or
the model dim where a rank holds fewer experts than there are such ranks. Ranks with the same chunk sizes of every
tensor share a role. The sizes are arithmetic on the unsharded model's shapes: the cost grows with the roles,
not the ranks, once the shapes are known.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from torch import nn

from ..layer import MoELayer
from ..parallel.fsdp import EXPERT_DIM


def chunk_size(length: int, parts: int, index: int) -> int:
    """The length of part `index` of torch.chunk(tensor of `length`, parts)."""
    size = -(-length // parts)
    return max(0, min(size, length - index * size))


def sharded_lengths(model: nn.Module, world_size: int, ep_size: int) -> List[Tuple[int, bool]]:
    """(length of the sharded dim, held by the expert ranks only) of each parameter of the unsharded model."""
    expert_dims: Dict[int, int] = {}
    holders = world_size // ep_size
    for layer in model.modules():
        if isinstance(layer, MoELayer) and layer.is_parallel:
            across = layer.groups.layout.local_experts < holders
            for name, param in layer.experts.named_parameters():
                expert_dims[id(param)] = EXPERT_DIM.get(name, 0) if across else 0
    return [(p.shape[expert_dims.get(id(p), 0)] if p.dim() else 1, id(p) in expert_dims)
            for p in model.parameters()]


def fsdp_roles(model: nn.Module, world_size: int, ep_size: int) -> List[List[int]]:
    """The ranks of each role under FSDP2, in rank order."""
    lengths = sharded_lengths(model, world_size, ep_size)
    holders = world_size // ep_size
    roles: Dict[tuple, List[int]] = {}
    for rank in range(world_size):
        key = tuple(chunk_size(n, holders, rank // ep_size) if expert else chunk_size(n, world_size, rank)
                    for n, expert in lengths)
        roles.setdefault(key, []).append(rank)
    return list(roles.values())
