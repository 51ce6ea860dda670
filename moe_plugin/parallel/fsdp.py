"""FSDP2 (torch.distributed.fsdp.fully_shard) for models holding MoE layers, with or without expert parallelism.

Shape legend: moe_plugin/__init__.py (here P the ranks holding the same experts, world_size / ep_size of them:
the layer's expert-data group; E_local experts per rank). world_size counts the world's ranks (W is one
expert-parallel group's).

A layer at ep_size 1 holds ordinary dense replicas: it is sharded with its block, exactly as the block's own
feed-forward would be (one FSDP unit per block, as a plain fully_shard per block gives). At ep_size > 1 each rank
of an ep group holds other experts, so its expert tensors are not replicas of the other ranks' and must not be
sharded over the world (plain fully_shard would gather a mix of experts). fully_shard_moe shards such a layer

    router, shared expert      over the dense mesh (all world_size ranks), like every other dense parameter
    experts                    over the P ranks holding the same experts

and divides the experts' reduce-scattered gradient by world_size, not P: each rank's loss is its own mean, and an
expert's gradient must end as DDP mode leaves it (parallel/expert_grads.py), the sum over its holders / world_size.
With torch's per-parameter mesh (shard_placement_fn returning a ShardPlacementResult) the experts stay in
their block's unit as a second parameter group, so a block is still one unit: one all-gather per mesh.
Without it (older torch) the router and shared expert get units of their own, then the layer one on the
expert mesh, then the block.

moe_plugin/guards.py's check_expert_sharding (called by MoELayer.forward) catches a plain fully_shard over the
wrong ranks; fsdp_state_dict.py answers torch's state-dict API (DCP, Accelerate, HF Trainer checkpoints) for
such layers.
"""
from __future__ import annotations

import sys
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..experts import WEIGHT_NAMES, ExpertWeights
from ..layer import MoELayer
from . import fsdp_state_dict
from .groups import check_ep_size

try:   # per-parameter meshes in one fully_shard call (pytorch PR 173509; absent from older torch)
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
except ImportError:
    FSDPMeshInfo = ShardPlacementResult = None

# the dim each expert tensor is sharded along when E_local < P: D (biases: E)
EXPERT_DIM = dict(zip(WEIGHT_NAMES, ExpertWeights(w1_EDH=1, b1_EH=0, w2_EHD=2, b2_ED=0)))


def fully_shard_moe(model: nn.Module, *, mesh=None, blocks: Optional[Iterable[nn.Module]] = None,
                    mp_policy=None, reshard_after_forward: Optional[bool] = None, offload_policy=None) -> nn.Module:
    """Shard model with FSDP2 so that expert-parallel MoE layers train as under DDP; returns model (an FSDPModule).

    mesh: the dense 1-D DeviceMesh over every rank (default: the whole world, on the model's device type).
    blocks: the modules to shard one by one before the root (default: the children of every nn.ModuleList
    that holds an MoE layer, i.e. the transformer blocks). mp_policy, offload_policy and reshard_after_forward
    are fully_shard's (None, its default: every unit but the root reshards). Call it once, after
    torch.distributed is initialized and after activation checkpointing is applied, before building the
    optimizer.
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
    _plain_swapped_blocks(model)
    parallel = [m for m in model.modules() if isinstance(m, MoELayer) and m.is_parallel]
    for name, layer in model.named_modules():   # before any collective (the default mesh's)
        if isinstance(layer, MoELayer) and layer.is_parallel:
            check_ep_size(layer.config.ep_size, f"fully_shard_moe: MoE layer {name!r}: ep_size", world,
                          num_experts=layer.config.num_experts, hidden_size=layer.config.hidden_size)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, (world,))
    if mesh.ndim != 1 or mesh.size() != world:
        raise ValueError(f"fully_shard_moe: mesh must be 1-D over all {world} ranks, got shape {tuple(mesh.shape)}")
    options = dict(mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                   **({"offload_policy": offload_policy} if offload_policy is not None else {}))
    if mp_policy is None:
        options.pop("mp_policy")

    sharded = list(parallel)
    meshes = {id(layer): expert_mesh(layer, device_type) for layer in parallel}
    if parallel and ShardPlacementResult is None:
        _shard_layers_apart(parallel, meshes, mesh, world, options, mp_policy)
        parallel = []
    units = [b for b in (default_blocks(model) if blocks is None else blocks)
             if b is not model and not isinstance(b, FSDPModule)]
    units += [] if isinstance(model, FSDPModule) else [model]
    infos = {}   # expert-data group -> its FSDPMeshInfo (fully_shard wants one object per group)
    for unit in units:
        inside = {id(m) for m in unit.modules()}
        here, parallel = [l for l in parallel if id(l) in inside], [l for l in parallel if id(l) not in inside]
        placements = {}
        for layer in here:
            experts_mesh = meshes[id(layer)]
            data_group = layer.groups.expert_data_group
            info = infos[data_group] = infos.get(data_group) or FSDPMeshInfo(mesh=experts_mesh, shard_mesh_dim=0)
            dims = _expert_dims(layer, experts_mesh.size())
            for param in layer.experts.parameters():
                placements[id(param)] = ShardPlacementResult(dims and _shard(dims.get(id(param), 0)), info)
        fully_shard(unit, mesh=mesh, shard_placement_fn=(lambda p, at=placements: at.get(id(p))) if here else None,
                    **options)
        for group in unit._get_fsdp_state()._fsdp_param_groups if here else []:
            if any(group.mesh_info is info for info in infos.values()):
                factor, force_sum = _expert_divide(float(world), group.mesh_info.shard_mesh_size, mp_policy, here[0])
                group.gradient_divide_factor, group.force_sum_reduction_for_comms = factor, force_sum
    for layer in sharded:
        fsdp_state_dict.register(layer, device_type)
    return model


def _plain_swapped_blocks(model: nn.Module) -> None:
    """DeepSpeed's subclass of the swapped HF block (what DeepSpeed's initialize makes of HFMoEBlocks) renames
    its experts in state_dict() to DeepSpeed's per-expert file names, for DeepSpeed's engine. torch's state-dict
    functions (get_model_state_dict, which Accelerate's FSDP2 save calls) walk every key as an attribute path
    and fail on those names: under FSDP2 the block is the plain HFMoEBlock, as under ZeRO-3."""
    deepspeed_hf = sys.modules.get("moe_plugin.integrations.deepspeed.hf")   # loaded if such a block exists
    for module in model.modules() if deepspeed_hf is not None else ():
        if isinstance(module, deepspeed_hf.DeepSpeedHFMoEBlock):
            module.__class__ = deepspeed_hf.HFMoEBlock


def _shard_layers_apart(layers, meshes, mesh, world: int, options, mp_policy) -> None:
    """Before torch's per-parameter meshes: the router and shared expert over mesh, then each layer (the
    experts left) over its expert mesh, each a unit of its own."""
    from torch.distributed.fsdp import fully_shard
    for layer in layers:
        for part in (layer.router, layer.shared_expert):
            if part is not None and any(True for _ in part.parameters()):
                fully_shard(part, mesh=mesh, **options)
        experts_mesh = meshes[id(layer)]
        dims = _expert_dims(layer, experts_mesh.size())
        fully_shard(layer, mesh=experts_mesh, **options,
                    shard_placement_fn=dims and (lambda p, dims=dims: _shard(dims.get(id(p), 0))))
        factor, force_sum = _expert_divide(float(world), experts_mesh.size(), mp_policy, layer)
        layer.set_gradient_divide_factor(factor)
        if force_sum:
            layer.set_force_sum_reduction_for_comms(True)


def _expert_divide(world: float, ranks: int, mp_policy, layer):
    """(divide factor, force a sum) that make a reduce-scatter over the P holders divide the experts'
    gradient sum by world_size.

    gloo has no PREMUL_SUM, so there it sums and then divides. With P = 1, torch (2.13) divides twice
    whenever it divides after the (skipped) reduction: with that forced sum, and for reduce dtypes other
    than fp32 and bf16; then the factor is sqrt(world_size)."""
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or getattr(mp_policy, "param_dtype", None) or \
        next(layer.experts.parameters()).dtype
    if ranks > 1:
        return world, dist.get_backend() == "gloo"
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return world, False
    return world ** 0.5, False


def expert_mesh(layer, device_type: str):
    """The 1-D DeviceMesh over the layer's expert-data group (the ranks holding its experts)."""
    from torch.distributed.device_mesh import DeviceMesh
    group = layer.groups.expert_data_group
    if group is None:
        raise ValueError("fully_shard_moe: this MoELayer was built with a host's ep_group, so it does not know "
                         "the ranks holding the same experts; build it without ep_group (ep_size from the "
                         "config) to shard it with FSDP2")
    return DeviceMesh.from_group(group, device_type)


def _expert_dims(layer, ranks: int):
    """None (Shard(0), over the experts) when each rank holds at least P experts; else {id(param): the dim
    to shard} along the model dim (EXPERT_DIM; others dim 0)."""
    if layer.groups.layout.local_experts >= ranks:
        return None
    return {id(getattr(layer.experts, name, None)): dim for name, dim in EXPERT_DIM.items()}


def _shard(dim: int):
    from torch.distributed.tensor import Shard
    return Shard(dim)


def default_blocks(model: nn.Module) -> List[nn.Module]:
    """The children of every nn.ModuleList in model that holds an MoELayer somewhere below it."""
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
