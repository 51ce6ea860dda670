"""DistributedDataParallel for models holding expert-parallel MoE layers: ddp_moe, and the check that catches a
plain DDP wrapping such a layer.

At ep_size > 1 each rank holds other experts. Plain DDP would broadcast rank 0's experts to every rank when it
is built and average expert gradients over ranks holding different experts. ddp_moe leaves the experts out of
DDP and hooks their gradients instead (expert_grads.py), as `moe-plugin train` does.
"""
from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

_DDP_MODULE = "torch.nn.parallel.distributed"
_PASSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # layer -> weakref to the DDP it passed in


def ddp_moe(model: nn.Module, **ddp_options) -> nn.Module:
    """torch's DistributedDataParallel(model, **ddp_options) with the experts of every expert-parallel MoELayer
    left out of it and their gradients hooked (summed over the ranks holding the same experts, divided by the
    world size, so they end as DDP leaves the shared ones). Call it after torch.distributed is initialized,
    instead of DistributedDataParallel."""
    import torch.distributed as dist

    from .expert_grads import hook_expert_grads   # here: it imports the layer, which imports this file
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ddp_moe needs torch.distributed to be initialized (torchrun, or "
                         "torch.distributed.init_process_group) before it is called")
    experts = hook_expert_grads(model, dist.get_world_size())
    DDP = torch.nn.parallel.DistributedDataParallel
    DDP._set_params_and_buffers_to_ignore_for_model(model, [name for name, _ in experts])
    return DDP(model, **ddp_options)


def check_plain_ddp(layer) -> None:
    """ValueError if a DistributedDataParallel running this expert-parallel layer's forward holds its experts
    (a plain DDP around the model). Looks at the stack only: no collective."""
    if torch.compiler.is_compiling():
        return
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == _DDP_MODULE:
            ddp = frame.f_locals.get("self")
            if not hasattr(ddp, "_module_parameters"):
                return
            passed = _PASSED.get(layer)
            if passed is not None and passed() is ddp:   # this DDP passed already: no rescan of its parameters
                return
            held = {id(p) for p in ddp._module_parameters}
            if any(id(p) in held for p in layer.experts.parameters()):
                raise ValueError(
                    f"an MoELayer with ep_size={layer.config.ep_size} runs inside a plain DistributedDataParallel "
                    f"that holds its experts: DDP broadcast rank 0's experts to every rank when it was built and "
                    f"would average expert gradients over ranks holding other experts. Wrap the model with "
                    f"moe_plugin.parallel.ddp_moe(model, ...) instead (it leaves the experts out of DDP and "
                    f"reduces their gradients over the ranks holding the same experts), or use ep_size 1")
            _PASSED[layer] = weakref.ref(ddp)
            return
        frame = frame.f_back


__all__ = ["ddp_moe", "check_plain_ddp"]
