"""The plan of a `moe-plugin train` experiment at any world size: each role's model built as the run builds it
(train/parts.py build_model, under torch.device("meta") and the fake process group; FSDP2 sharded where the run
shards) and its bytes counted; assembly.py adds the traffic, activations and step time. Under DDP the gradients
are views into DDP's buckets (train/parts.py data_parallel): the buckets are the gradients counted, not a copy.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from ..parallel.fsdp import default_blocks, fully_shard_moe
from ..parallel.groups import divisors
from ..train.checks import check_world as check_processes
from ..train.checks import layer_configs
from ..train.parts import build_model
from .assembly import Collectives, Plan, assemble, split_bytes
from .devices import Device
from .fake_world import fake_world
from .roles import fsdp_roles, sharded_lengths
from .state_bytes import nbytes, state_bytes
from .traffic import check_capacity


DEFAULT_NODE_SIZE = 8


def node_size_of(world_size: int, given: Optional[int]) -> int:
    """--node-size as given (or the default, DEFAULT_NODE_SIZE), at most --world-size; ValueError naming the flag the
    user gave, or the default by name, when it does not divide --world-size."""
    _check_counts(("--world-size", world_size), ("--node-size", given))
    node_size = min(DEFAULT_NODE_SIZE if given is None else given, world_size)
    if world_size % node_size == 0:
        return node_size
    if given is None:
        raise ValueError(f"--world-size={world_size} is not a multiple of the default --node-size, "
                         f"{DEFAULT_NODE_SIZE} processes per node: give --node-size M, M one of "
                         f"{divisors(world_size)}")
    raise ValueError(f"--node-size={given} is invalid: must divide --world-size={world_size} (one of "
                     f"{divisors(world_size)})")


def _check_counts(*named) -> None:
    """ValueError for the first (flag, value) whose value is not an integer >= 1 (None: not given, passes)."""
    for name, value in named:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")


def check_world_size(world_size: int, node_size: int) -> None:
    _check_counts(("--world-size", world_size), ("--node-size", node_size))
    if world_size % node_size:
        raise ValueError(f"--node-size={node_size} is invalid: must divide --world-size={world_size} (one of "
                         f"{divisors(world_size)})")


def check_world(cfg, world_size: int, node_size: int) -> None:
    """The errors the run would meet at start, found before anything is built."""
    check_world_size(world_size, node_size)
    check_processes(cfg, world_size, "plan with --world-size N")
    if cfg.parallel.fsdp and world_size == 1:
        raise ValueError("parallel.fsdp=true is invalid with --world-size=1: FSDP2 shards over >= 2 processes")
    if cfg.data.task != "lm":
        raise ValueError(f"data.task={cfg.data.task!r} is not planned: moe-plugin plan covers language models "
                         f"(data.task=lm)")
    for config in layer_configs(cfg):
        check_capacity(config, cfg.train.batch_size * cfg.model.seq_len, "moe.capacity_factor", "train.batch_size")


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


def block_parameter_ids(model: nn.Module) -> set:
    """The ids of the parameters in FSDP2's block units (parallel/fsdp.py's default_blocks); the rest is the root's."""
    return {id(p) for block in default_blocks(model) for p in block.parameters()}


def fsdp_collectives(model: nn.Module, world_size: int, ep_size: int) -> Collectives:
    """The bytes FSDP2 hands to its collectives in one step on every rank, from the unsharded model (units as
    parallel/fsdp.py makes them, fully_shard's defaults): each trainable gradient reduce-scattered once, each
    parameter all-gathered forward and again backward, but the root unit's (torch keeps it gathered after
    forward). Each tensor is padded as FSDP2 pads it (its sharded dim to a multiple of the ranks sharing it);
    experts held by one rank alone (world_size == ep_size) are not exchanged."""
    in_blocks = block_parameter_ids(model)
    holders = world_size // ep_size
    reduced = gathered = 0
    for param, (length, expert) in zip(model.parameters(), sharded_lengths(model, world_size, ep_size)):
        ranks = holders if expert else world_size
        if ranks > 1:
            padded = nbytes(param) // length * (-(-length // ranks) * ranks)
            reduced += padded if param.requires_grad else 0
            gathered += padded * (2 if id(param) in in_blocks else 1)
    return Collectives(reduce_scatter=reduced, all_gather=gathered)


def root_unit_bytes(model: nn.Module) -> int:
    """The trainable bytes of FSDP2's root unit: the parameters outside the blocks."""
    in_blocks = block_parameter_ids(model)
    return sum(nbytes(p) for p in model.parameters() if p.requires_grad and id(p) not in in_blocks)


def plan_experiment(cfg, world_size: int, node_size: int, device: Device, skew=None) -> Plan:
    check_world(cfg, world_size, node_size)
    ep_size, fsdp = cfg.parallel.ep_size, cfg.parallel.fsdp
    first = build_role(cfg, 0, world_size, node_size, shard=False)
    dense_bytes, expert_bytes = split_bytes(first)
    local = copy.deepcopy(cfg)
    local.parallel.ep_size, local.parallel.fsdp = 1, False
    if fsdp:
        groups = fsdp_roles(first, world_size, ep_size)
        held = [(ranks, state_bytes(build_role(cfg, ranks[0], world_size, node_size, shard=True)))
                for ranks in groups]
        collectives = fsdp_collectives(first, world_size, ep_size)
    else:
        held = [(list(range(world_size)), state_bytes(first))]
        holders = world_size // ep_size
        collectives = Collectives(all_reduce=(dense_bytes if world_size > 1 else 0) +
                                  (expert_bytes if holders > 1 else 0))
    return assemble(first, held, collectives, cfg.train.batch_size, cfg.model.seq_len, lambda: build_model(local),
                    world_size, node_size, device, fsdp, "train.batch_size",
                    "parallel.ep_size (experts over more ranks), parallel.fsdp=true (parameters, gradients and "
                    "optimizer state sharded), moe.recompute=experts (see the recompute line), a smaller "
                    "moe.capacity_factor", "moe.capacity_factor", root_unit_bytes(first) if fsdp else 0, skew)
