"""DistributedDataParallel for models holding expert-parallel MoE layers: ddp_moe (moe_plugin/guards.py's
check_plain_ddp catches a plain DDP wrapping such a layer).

At ep_size > 1 each rank holds other experts. Plain DDP would broadcast rank 0's experts to every rank when it
is built and average expert gradients over ranks holding different experts. ddp_moe leaves the experts out of
DDP and hooks their gradients instead (expert_grads.py), as `moe-plugin train` does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .expert_grads import hook_expert_grads


def ddp_moe(model: nn.Module, **ddp_options) -> nn.Module:
    """torch's DistributedDataParallel(model, **ddp_options) with the experts of every expert-parallel MoELayer
    left out of it and their gradients hooked (summed over the ranks holding the same experts, divided by the
    world size, so they end as DDP leaves the shared ones). Call it after torch.distributed is initialized,
    instead of DistributedDataParallel."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ddp_moe needs torch.distributed to be initialized (torchrun, or "
                         "torch.distributed.init_process_group) before it is called")
    experts = hook_expert_grads(model, dist.get_world_size())
    DDP = torch.nn.parallel.DistributedDataParallel
    DDP._set_params_and_buffers_to_ignore_for_model(model, [name for name, _ in experts])
    return DDP(model, **ddp_options)


__all__ = ["ddp_moe"]
