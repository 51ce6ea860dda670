"""Misuse guards MoELayer.forward runs at ep_size > 1: a host wrapper around the model that would mix ranks'
experts (a plain fully_shard over the wrong ranks, a plain DistributedDataParallel holding the experts) is a
ValueError naming the wrapper to use instead (parallel/fsdp.py's fully_shard_moe, parallel/ddp.py's ddp_moe).

They look at torch's own state only (FSDP2's composable states, the Python stack), no collective, and import
nothing from this package: the wrappers import the layer, never the reverse.
"""
from __future__ import annotations

import sys
import weakref

import torch
import torch.distributed as dist

try:
    from torch.distributed._composable_state import _module_state_mapping as _STATES   # module -> its FSDP state
except ImportError:
    _STATES = None

_DDP_MODULE = "torch.nn.parallel.distributed"
_PASSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # layer -> weakref to the DDP it passed in


def check_expert_sharding(layer) -> None:
    """ValueError if an FSDP2 state shards this expert-parallel layer's experts over ranks that hold other
    experts (a plain fully_shard on a parent). No collective; it rescans only when the number of composable
    states (fully_shard calls) has changed since the layer last looked, so a forward costs one len()."""
    if _STATES is None or len(_STATES) == getattr(layer, "_fsdp_states_seen", -1):
        return
    ep_ranks = set(dist.get_process_group_ranks(layer.groups.ep_group))
    for state in list(_STATES.values()):
        state = state()
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                if fsdp_param._module_info.module is not layer.experts:
                    continue
                mesh_ranks = set(fsdp_param.mesh_info.mesh.mesh.flatten().tolist())
                if mesh_ranks & ep_ranks != {dist.get_rank()}:
                    raise ValueError(
                        f"an MoELayer with ep_size={layer.config.ep_size} was sharded by fully_shard over ranks "
                        f"{sorted(mesh_ranks)}, which hold different experts (its ep group is {sorted(ep_ranks)}): "
                        f"the gathered experts would mix ranks' experts. Shard the model with "
                        f"moe_plugin.parallel.fully_shard_moe(model) instead (it shards the experts over the "
                        f"ranks holding the same experts), before any other fully_shard call")
    layer._fsdp_states_seen = len(_STATES)


def _param_groups(state) -> list:
    if state is None:
        return []
    groups = getattr(state, "_fsdp_param_groups", None)   # torch >= 2.13; before, one _fsdp_param_group
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


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
