"""Expert gradients under data parallelism, for a host that all-reduces the other gradients itself.

Each of the world_size ranks of the world computes a loss over its own tokens, and the host averages the
shared gradients over the world. An expert's gradient must stay out of that all-reduce (each rank
holds different experts): it comes back through the all-to-all already summed over the tokens of
the expert's whole ep group, and the ranks holding the same experts in the other ep groups (the
layer's expert-data group, when world_size > ep_size) hold the rest. A hook on each expert parameter sums
its gradient over that group and divides by world_size, so it ends as a shared gradient does: the sum over
every rank's gradient of its own loss, divided by world_size.

Shape legend: moe_plugin/__init__.py (world_size counts the world's ranks; W is one expert-parallel group's).
"""
from __future__ import annotations

import functools
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..layer import MoELayer


def expert_layers(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """(name prefix, layer) of every expert-parallel MoELayer in model; the prefix is "" or ends in "."."""
    for name, module in model.named_modules():
        if isinstance(module, MoELayer) and module.is_parallel:
            yield (f"{name}." if name else ""), module


def expert_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(name in model, parameter) of the experts of every expert-parallel MoELayer in model."""
    return [(f"{prefix}experts.{name}", param) for prefix, layer in expert_layers(model)
            for name, param in layer.experts.named_parameters()]


def hook_expert_grads(model: nn.Module, world_size: int) -> List[Tuple[str, nn.Parameter]]:
    """Hook every expert parameter of model's expert-parallel MoELayers (see the module doc); returns them."""
    for _, layer in expert_layers(model):
        group = layer.groups.expert_data_group
        replicas = None if group is None or dist.get_world_size(group) == 1 else group
        for param in layer.experts.parameters():
            param.register_hook(functools.partial(_expert_grad, world_size, replicas))
    return expert_parameters(model)


def _expert_grad(world_size: int, replicas: Optional[object], grad: torch.Tensor) -> torch.Tensor:
    if replicas is not None:
        grad = grad.clone()
        dist.all_reduce(grad, group=replicas)
    return grad / world_size
