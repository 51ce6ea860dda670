"""Who holds which experts, and the process groups the exchanges run on.

Shape legend: moe_plugin/__init__.py (here W ranks in the expert-parallel (ep) group, E experts, slices = W / E
hidden slices per expert when E < W, V ranks that gather their slices into one compute slice, r the parallel
degree).

Parameters never move: with E >= W a rank owns E / W whole experts; with E < W it owns hidden
slice (rank % slices) of expert rank // slices. A degree r only changes what is gathered for one call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch.distributed as dist


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def holds(E: int, H: int, W: int) -> bool:
    """Whether W ranks can hold E experts of hidden size H: W divides E, or E divides W and W / E divides H."""
    return (E >= W and E % W == 0) or (E < W and W % E == 0 and H % (W // E) == 0)


def ep_sizes_that_work(num_experts: int, hidden_size: int, processes: Optional[int] = None) -> List[int]:
    """The ep_sizes that hold num_experts experts of hidden_size and (processes given) divide processes."""
    E, H = num_experts, hidden_size
    candidates = divisors(processes) if processes else range(1, 4 * max(E, 1) + 1)
    return [w for w in candidates if holds(E, H, w)]


def check_sizes(num_experts: int, hidden_size: int, ep_size: int, processes: Optional[int] = None) -> None:
    """ValueError for an ep_size that cannot hold num_experts experts of hidden_size; the sizes it suggests also
    divide processes (the number of processes sharing the experts), when given."""
    E, H, W = num_experts, hidden_size, ep_size
    if holds(E, H, W):
        return
    working = ep_sizes_that_work(E, H, processes)
    on = "" if not processes else f" on {processes} processes"
    raise ValueError(
        f"ep_size={W} cannot hold num_experts={E} with hidden_size={H}: ep_size must divide num_experts, "
        f"or be a multiple of it that divides each expert's hidden_size into equal slices; "
        f"sizes that work{on}: {working[:12]}{' ...' if len(working) > 12 else ''}")


def check_ep_size(ep_size: int, setting: str = "ep_size", world_size: Optional[int] = None, stages: int = 1,
                  processes_from: str = "launch with torchrun --nproc_per_node N", num_experts: Optional[int] = None,
                  hidden_size: Optional[int] = None) -> None:
    """ValueError unless ep_size divides the number of processes that share the experts.

    setting: the name the user gave ep_size (`parallel.ep_size`, `DeepSpeed config "moe.ep_size"`, ...).
    world_size: default torch.distributed's (ep_size > 1 then needs it initialized). stages: pipeline stages,
    each holding world_size / stages processes (DeepSpeed splits its expert groups inside a stage). processes_from:
    how the user sets the number of processes N (moe-plugin plan: its --world-size). num_experts, hidden_size: the
    layer's, when known; the sizes suggested then also hold its experts (check_sizes)."""
    if world_size is None:
        if ep_size == 1:
            return
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"{setting}={ep_size} needs torch.distributed to be initialized (torchrun, or "
                             f"torch.distributed.init_process_group) before the layer is built")
        world_size = dist.get_world_size()
    processes = world_size // stages
    if processes % ep_size == 0:
        return
    per_stage = "" if stages == 1 else " per pipeline stage"
    stage_note = "" if stages == 1 else f"{world_size} processes in {stages} pipeline stages; "
    suggested = divisors(processes) if num_experts is None or hidden_size is None else \
        ep_sizes_that_work(num_experts, hidden_size, processes)
    raise ValueError(f"{setting}={ep_size} is invalid: must divide the number of processes{per_stage}, {processes} "
                     f"({stage_note}{processes_from}, N a multiple of {ep_size * stages}; "
                     f"or set it to one of {suggested})")


@dataclass
class ExpertLayout:
    num_experts: int
    hidden_size: int
    ep_size: int
    ep_rank: int

    def __post_init__(self):
        check_sizes(self.num_experts, self.hidden_size, self.ep_size)

    @property
    def slices(self) -> int:
        return max(1, self.ep_size // self.num_experts)

    @property
    def local_experts(self) -> int:
        return max(1, self.num_experts // self.ep_size)

    @property
    def local_hidden(self) -> int:
        return self.hidden_size // self.slices

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.local_experts if self.slices == 1 else self.ep_rank // self.slices

    @property
    def slice_index(self) -> int:
        return self.ep_rank % self.slices

    def degrees(self) -> List[int]:
        """The parallel degrees r this layout can run: 0 (gathered) and the divisors of slices."""
        return [0] + divisors(self.slices)

    def check_degree(self, r: int) -> None:
        if r not in self.degrees():
            raise ValueError(f"parallel degree r={r} is not possible with num_experts={self.num_experts} on "
                             f"ep_size={self.ep_size}; possible: {self.degrees()}")

    def gather_size(self, r: int) -> int:
        """V: ranks whose slices make one compute slice under degree r >= 1."""
        return self.slices // r

    def destinations(self, expert: int, source_rank: int, r: int) -> List[int]:
        """Ranks that compute (a slice of) `expert` for tokens from source_rank under degree r >= 1."""
        if self.slices == 1:
            return [expert // self.local_experts]
        V = self.gather_size(r)
        replica = source_rank % V
        return [expert * self.slices + m * V + replica for m in range(r)]

    def computes_first_slice(self, r: int) -> bool:
        return self.slices == 1 or self.slice_index // self.gather_size(r) == 0


@dataclass
class ExpertGroups:
    """The ep group this rank belongs to and its sub-groups (built collectively by every rank)."""
    ep_group: Optional[object]
    layout: ExpertLayout
    node_size: int
    intra_node_group: Optional[object] = None
    inter_node_group: Optional[object] = None
    gather_groups: Dict[int, object] = field(default_factory=dict)   # degree r -> group of V ranks
    expert_data_group: Optional[object] = None                         # same experts across ep groups


def node_size_from(config_node_size: Optional[int], ep_size: int) -> int:
    node = config_node_size or int(os.environ.get("LOCAL_WORLD_SIZE", ep_size))
    node = min(node, ep_size)
    if ep_size % node:
        raise ValueError(f"node_size={node} must divide ep_size={ep_size} (node size comes from "
                         f"MoEConfig.node_size or LOCAL_WORLD_SIZE)")
    return node


def ep_blocks(world: int, ep_size: int) -> List[List[int]]:
    """The ep groups build_groups makes of a default world: blocks of ep_size consecutive ranks."""
    return [list(range(start, start + ep_size)) for start in range(0, world, ep_size)]


def build_groups(num_experts: int, hidden_size: int, ep_size: int, node_size: Optional[int] = None,
                 ep_group: Optional[object] = None) -> ExpertGroups:
    """Split the default world into ep groups of ep_size consecutive ranks (or use the host's ep_group).

    Every rank must call this in the same order: torch.distributed.new_group is collective.
    """
    world = dist.get_world_size() if ep_group is None and dist.is_available() and dist.is_initialized() else None
    check_sizes(num_experts, hidden_size, ep_size, world)
    if ep_group is None:
        check_ep_size(ep_size, num_experts=num_experts, hidden_size=hidden_size)
    if ep_size == 1 and ep_group is None:
        return ExpertGroups(None, ExpertLayout(num_experts, hidden_size, 1, 0), 1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_group is None:
        blocks = ep_blocks(world, ep_size)
        for block in blocks:
            group = dist.new_group(block)
            if rank in block:
                ep_group = group
        expert_data_ranks = [[block[i] for block in blocks] for i in range(ep_size)]
        expert_data_group = None
        for ranks in expert_data_ranks:
            group = dist.new_group(ranks)
            if rank in ranks:
                expert_data_group = group
    else:
        expert_data_group = None
        if dist.get_world_size(ep_group) != ep_size:
            raise ValueError(f"the ep_group passed in has {dist.get_world_size(ep_group)} ranks, "
                             f"but ep_size={ep_size}")
    ep_ranks = dist.get_process_group_ranks(ep_group)
    ep_rank = dist.get_rank(ep_group)
    layout = ExpertLayout(num_experts, hidden_size, ep_size, ep_rank)
    node = node_size_from(node_size, ep_size)
    groups = ExpertGroups(ep_group, layout, node, expert_data_group=expert_data_group)

    # every rank of the world takes part in every new_group call, in the same order
    all_ep_blocks = _all_ep_blocks(ep_ranks, world, ep_size)
    for local_ranks in _sub_blocks(all_ep_blocks, lambda i: i // node, ep_size):
        group = dist.new_group(local_ranks)
        if dist.get_rank() in local_ranks:
            groups.intra_node_group = group
    for cross_ranks in _sub_blocks(all_ep_blocks, lambda i: i % node, ep_size):
        group = dist.new_group(cross_ranks)
        if dist.get_rank() in cross_ranks:
            groups.inter_node_group = group
    for r in layout.degrees():
        if r == 0:
            groups.gather_groups[0] = ep_group
            continue
        V = layout.gather_size(r)
        for members in _sub_blocks(all_ep_blocks, lambda i, V=V: i // V, ep_size):
            group = dist.new_group(members) if V > 1 else None
            if dist.get_rank() in members:
                groups.gather_groups[r] = group
    return groups


def _all_ep_blocks(ep_ranks: List[int], world: int, ep_size: int) -> List[List[int]]:
    """The ep groups of the whole world: consecutive blocks like a host-given consecutive group; else (e.g.
    DeepSpeed's groups under tensor parallelism, [0, 2] and [1, 3]) every rank's group, gathered, so that every
    rank makes the same new_group calls."""
    consecutive = ep_ranks == list(range(ep_ranks[0], ep_ranks[0] + ep_size))
    if consecutive and world % ep_size == 0:
        return [list(range(start, start + ep_size)) for start in range(0, world, ep_size)]
    if consecutive:
        return [ep_ranks]
    every: List[List[int]] = [[] for _ in range(world)]
    dist.all_gather_object(every, list(ep_ranks))
    return sorted({tuple(ranks): list(ranks) for ranks in every}.values())


def _sub_blocks(blocks: List[List[int]], key, ep_size: int) -> List[List[int]]:
    """Split each ep block into sub-lists of ranks whose in-block index shares key(index)."""
    out = []
    for block in blocks:
        keys: Dict[int, List[int]] = {}
        for i, rank in enumerate(block):
            keys.setdefault(key(i), []).append(rank)
        out.extend(keys.values())
    return out
