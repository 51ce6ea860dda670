"""FSDP2 (torch.distributed.fsdp.fully_shard) for models holding MoE layers, with or without expert parallelism.

Legend: W ranks in the world, P = W / ep_size ranks holding the same experts (the layer's expert-data
group), E_local experts per rank.

Each rank of an ep group holds other experts, so its expert tensors are not replicas of the other
ranks' and must not be sharded over the world (plain fully_shard would gather a mix of experts).
fully_shard_moe shards every MoELayer in three parts:

    router, shared expert      over the dense mesh (all W ranks), like every other dense parameter
    experts                    over the P ranks holding the same experts (the layer's own fully_shard)

and divides the experts' reduce-scattered gradient by W, not P: each rank's loss is its own mean, and an
expert's gradient must end as DDP mode leaves it (parallel/expert_grads.py), the sum over its holders / W.
The router and shared expert are sharded first, so the layer's own fully_shard is left with the experts.

check_expert_sharding (called by MoELayer.forward) catches a plain fully_shard over the wrong ranks.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

try:
    from torch.distributed._composable_state import _module_state_mapping as _STATES   # module -> its FSDP state
except ImportError:
    _STATES = None

EXPERT_DIM = {"w1_EDH": 1, "w2_EHD": 2, "b1_EH": 0, "b2_ED": 0}   # sharded dim when E_local < P: D (biases: E)


def fully_shard_moe(model: nn.Module, *, mesh=None, blocks: Optional[Iterable[nn.Module]] = None,
                    mp_policy=None, reshard_after_forward: bool = True, offload_policy=None) -> nn.Module:
    """Shard model with FSDP2 so that expert-parallel MoE layers train as under DDP; returns model (an FSDPModule).

    mesh: the dense 1-D DeviceMesh over every rank (default: the whole world, on the model's device type).
    blocks: the modules to shard one by one between the MoE layers and the root (default: the children of
    every nn.ModuleList that holds an MoE layer, i.e. the transformer blocks). mp_policy, offload_policy and
    reshard_after_forward are fully_shard's. Call it once, after torch.distributed is initialized and after
    activation checkpointing is applied, before building the optimizer.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("fully_shard_moe needs torch.distributed to be initialized (torchrun, or "
                         "torch.distributed.init_process_group) before it is called")
    if isinstance(model, FSDPModule):
        raise ValueError(f"fully_shard_moe got a model that is already sharded ({type(model).__name__}); "
                         f"call it once, on the unsharded model")
    world = dist.get_world_size()
    device_type = _device_type(model)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, (world,))
    if mesh.ndim != 1 or mesh.size() != world:
        raise ValueError(f"fully_shard_moe: mesh must be 1-D over all {world} ranks, got shape {tuple(mesh.shape)}")
    options = dict(mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                   **({"offload_policy": offload_policy} if offload_policy is not None else {}))
    if mp_policy is None:
        options.pop("mp_policy")

    from ..layer import MoELayer
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        for part in (layer.router, layer.shared_expert):
            if part is not None and any(True for _ in part.parameters()):
                fully_shard(part, mesh=mesh, **options)
        if layer.is_parallel:
            experts_mesh = expert_mesh(layer, device_type)
            fully_shard(layer, mesh=experts_mesh, shard_placement_fn=_placement_fn(layer, experts_mesh.size()),
                        **options)
            _divide_gradients(layer, float(world), experts_mesh.size(), mp_policy)
        else:
            fully_shard(layer, mesh=mesh, **options)
    for block in (default_blocks(model) if blocks is None else blocks):
        if block is not model and not isinstance(block, FSDPModule):
            fully_shard(block, mesh=mesh, **options)
    if not isinstance(model, FSDPModule):
        fully_shard(model, mesh=mesh, **options)
    return model


def _divide_gradients(layer, world: float, ranks: int, mp_policy) -> None:
    """Make the layer's reduce-scatter over its P ranks divide the experts' gradient sum by W.

    gloo has no PREMUL_SUM, so there it sums and then divides. With P = 1, torch (2.13) divides twice
    whenever it divides after the (skipped) reduction: with that forced sum, and for reduce dtypes other
    than fp32 and bf16; then the factor is sqrt(W)."""
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or getattr(mp_policy, "param_dtype", None) or \
        next(layer.experts.parameters()).dtype
    if ranks > 1:
        layer.set_gradient_divide_factor(world)
        if dist.get_backend() == "gloo":
            layer.set_force_sum_reduction_for_comms(True)
    elif reduce_dtype in (torch.float32, torch.bfloat16):
        layer.set_gradient_divide_factor(world)
    else:
        layer.set_gradient_divide_factor(world ** 0.5)


def expert_mesh(layer, device_type: str):
    """The 1-D DeviceMesh over the layer's expert-data group (the ranks holding its experts)."""
    from torch.distributed.device_mesh import DeviceMesh
    group = layer.groups.expert_data_group
    if group is None:
        raise ValueError("fully_shard_moe: this MoELayer was built with a host's ep_group, so it does not know "
                         "the ranks holding the same experts; build it without ep_group (ep_size from the "
                         "config) to shard it with FSDP2")
    return DeviceMesh.from_group(group, device_type)


def _placement_fn(layer, ranks: int):
    """Shard(0) over the experts when each rank holds at least P of them; else the model dim (see EXPERT_DIM)."""
    from torch.distributed.tensor import Shard
    if layer.groups.layout.local_experts >= ranks:
        return None
    dims = {id(getattr(layer.experts, name, None)): dim for name, dim in EXPERT_DIM.items()}
    return lambda param: Shard(dims.get(id(param), 0))


def default_blocks(model: nn.Module) -> List[nn.Module]:
    """The children of every nn.ModuleList in model that holds an MoELayer somewhere below it."""
    from ..layer import MoELayer
    out = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and any(isinstance(m, MoELayer) for m in module.modules()):
            out.extend(module.children())
    return out


def _device_type(model: nn.Module) -> str:
    devices = {p.device.type for p in model.parameters()} - {"meta"}
    if len(devices) > 1:
        raise ValueError(f"fully_shard_moe: the model's parameters are on several device types {sorted(devices)}")
    if devices:
        return devices.pop()
    return "cuda" if torch.cuda.is_available() else "cpu"


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
