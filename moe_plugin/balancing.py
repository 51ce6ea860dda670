"""Auxiliary-loss-free balancing (DeepSeek-V3; Wang et al. 2024, arXiv 2408.15664): once per optimizer
step, move each router's expert bias towards the experts that got fewer tokens than the mean.

Legend: E experts, L MoE layers with the bias on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .router import Router


def update_expert_bias(model: nn.Module, group=None) -> int:
    """bias_e += rate * sign(mean load - load_e) in every MoE layer of model with
    expert_bias_update_rate > 0, from the choices counted since the last call (all micro-batches);
    clears the counts. Under torch.distributed the counts are first summed over `group` (default:
    every process), so every process keeps the same bias; every process must call it. Returns how
    many layers it updated (0 when none has the bias on). Adds no host synchronization."""
    routers = [m for m in model.modules() if isinstance(m, Router) and m.config.expert_bias_update_rate > 0]
    if not routers:
        return 0
    loads = [router.take_load() for router in routers]
    load_LE = torch.cat(loads)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(load_LE, group=group)
    for router, load_E in zip(routers, load_LE.split([load.numel() for load in loads])):
        router.update_bias(load_E)
    return len(routers)
