"""The plan of a `moe-plugin train` experiment at any world size: each role's model built as the run builds it
(train/parts.py build_model, under torch.device("meta") and the fake process group; FSDP2 sharded where the run
shards), its bytes counted, and one micro-batch's forward run on the meta device for the activations and FLOPs.

Legend: B rows per rank (the micro-batch), S sequence length.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ..layer import MoELayer
from ..parallel.fsdp import fully_shard_moe
from ..parallel.groups import check_ep_size
from ..train.parts import build_model
from .devices import Device
from .fake_world import fake_world
from .roles import fsdp_roles
from .state_bytes import nbytes, saved_for_backward, state_bytes
from .step_time import StepTime, step_time
from .traffic import LayerTraffic, layer_traffic


@dataclass
class Role:
    ranks: List[int]
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    all_to_all_bytes: int           # one step, balanced routing
    all_to_all_bound_bytes: int     # one step, the busiest rank at the capacity bound
    all_reduce_bytes: int           # gradients handed to all-reduce (DDP)
    reduce_scatter_bytes: int       # gradients handed to reduce-scatter (FSDP2)
    all_gather_bytes: int           # parameters gathered, forward and backward (FSDP2)
    peak_bytes: int


@dataclass
class Plan:
    world_size: int
    node_size: int
    device: Device
    micro_batch: int
    tokens_per_rank: int
    roles: List[Role]
    layers: List[LayerTraffic]
    step: StepTime
    max_micro_batch: int
    activation_bytes_per_row: int
    warnings: List[str] = field(default_factory=list)


def check_world(cfg, world_size: int, node_size: int) -> None:
    """The errors the run would meet at start, found before anything is built."""
    for name, value in (("--world-size", world_size), ("--node-size", node_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
    if world_size % node_size:
        raise ValueError(f"--node-size={node_size} is invalid: must divide --world-size={world_size}")
    check_ep_size(cfg.parallel.ep_size, "parallel.ep_size", world_size)
    if cfg.parallel.fsdp and world_size == 1:
        raise ValueError("parallel.fsdp=true is invalid with --world-size=1: FSDP2 shards over >= 2 processes")
    if cfg.data.task != "lm":
        raise ValueError(f"data.task={cfg.data.task!r} is not planned: moe-plugin plan covers language models "
                         f"(data.task=lm)")


def build_role(cfg, rank: int, world_size: int, node_size: int, shard: bool) -> nn.Module:
    """Rank `rank`'s model, on the meta device, sharded by FSDP2 when `shard` (as train/parts.py builds it)."""
    with fake_world(rank, world_size, node_size):
        with torch.device("meta"):
            model = build_model(cfg)
        if shard:
            try:
                fully_shard_moe(model)
            except NotImplementedError as error:    # torch's FSDP2 refuses the shapes: so would the run
                raise ValueError(f"parallel.fsdp=true fails at --world-size={world_size}: FSDP2 says "
                                 f"{str(error).splitlines()[0]}") from None
    return model


def split_bytes(model: nn.Module) -> Tuple[int, int]:
    """(dense, expert-parallel experts') trainable parameter bytes of an unsharded model."""
    experts = {id(p) for m in model.modules() if isinstance(m, MoELayer) and m.is_parallel
               for p in m.experts.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return (sum(nbytes(p) for p in trainable if id(p) not in experts),
            sum(nbytes(p) for p in trainable if id(p) in experts))


def forward_without_data(cfg, rows: int) -> Tuple[int, float]:
    """(bytes saved for backward, forward FLOPs) of one forward + loss on `rows` rows, the experts local (each rank
    computes, at balanced routing, as many rows as it routes). The model is built on the meta device, then given
    CPU fake tensors (torch's FakeTensorMode: shapes, no data), so that the forward takes the CPU kernels' paths
    and saves what they save."""
    local = copy.deepcopy(cfg)
    local.parallel.ep_size, local.parallel.fsdp = 1, False
    with torch.device("meta"):
        model = build_model(local)
    saved: Dict[str, int] = {}
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")       # kernels without data
        model.to_empty(device="cpu")
        x_BS = torch.zeros(rows, cfg.model.seq_len, dtype=torch.long)
        with FlopCounterMode(display=False) as flops, saved_for_backward(model, saved):
            logits = model(x_BS)
            F.cross_entropy(logits.flatten(0, -2), x_BS.flatten())
    return saved["bytes"], float(flops.get_total_flops())


def plan_experiment(cfg, world_size: int, node_size: int, device: Device) -> Plan:
    check_world(cfg, world_size, node_size)
    ep_size, fsdp = cfg.parallel.ep_size, cfg.parallel.fsdp
    first = build_role(cfg, 0, world_size, node_size, shard=False)
    dense_bytes, expert_bytes = split_bytes(first)
    B, S = cfg.train.batch_size, cfg.model.seq_len
    moe_layers = [m for m in first.modules() if isinstance(m, MoELayer)]
    configs = [m.config for m in moe_layers]

    def traffic(rows: int) -> List[LayerTraffic]:
        return [layer_traffic(m.config, rows * S, next(m.experts.parameters()).element_size(), node_size)
                for m in moe_layers]

    def activations_at(rows: int) -> Tuple[int, float]:
        """(bytes kept for backward, forward FLOPs) of a micro-batch of `rows` rows."""
        saved, flops = forward_without_data(cfg, rows)
        return saved + sum(t.kept_bytes for t in traffic(rows)), flops

    layers = traffic(B)
    activations, flops = activations_at(B)
    per_row = activations - activations_at(B - 1)[0] if B > 1 else activations_at(2)[0] - activations
    holders = world_size // ep_size
    if fsdp:
        groups = fsdp_roles(first, world_size, ep_size)
        models = [(ranks, build_role(cfg, ranks[0], world_size, node_size, shard=True)) for ranks in groups]
        reduce_scatter, all_gather, all_reduce = dense_bytes + expert_bytes, 2 * (dense_bytes + expert_bytes), 0
    else:
        models = [(list(range(world_size)), first)]
        reduce_scatter = all_gather = 0
        all_reduce = (dense_bytes if world_size > 1 else 0) + (expert_bytes if holders > 1 else 0)
    roles = []
    for ranks, model in models:
        held = state_bytes(model)
        roles.append(Role(ranks, held.parameters, held.gradients, held.optimizer, activations,
                          sum(t.bytes_balanced for t in layers), sum(t.bytes_bound for t in layers),
                          all_reduce, reduce_scatter, all_gather,
                          held.parameters + held.gradients + held.optimizer + activations))
    timing = step_time(device.params, world_size, node_size, flops, configs, layers, dense_bytes, expert_bytes,
                       ep_size, fsdp)
    fixed = max(r.parameters_bytes + r.gradients_bytes + r.optimizer_bytes for r in roles)
    room = device.memory_bytes - fixed - (activations - B * per_row)
    max_batch = max(0, room // per_row) if per_row > 0 else 0
    plan = Plan(world_size, node_size, device, B, B * S, roles, layers, timing, int(max_batch), per_row)
    if max(r.peak_bytes for r in roles) > device.memory_bytes:
        plan.warnings.append(
            f"the plan needs {max(r.peak_bytes for r in roles) / 2**30:.1f} GiB on a rank, over the "
            f"{device.memory_bytes / 2**30:.0f} GiB of a {device.name}: "
            + (f"the largest micro-batch that fits is train.batch_size={plan.max_micro_batch}" if plan.max_micro_batch
               else "not even train.batch_size=1 fits (a shorter model.seq_len may)")
            + "; other levers: parallel.ep_size (experts over more ranks), "
            f"parallel.fsdp=true (parameters, gradients and optimizer state sharded), a smaller moe.capacity_factor")
    return plan
