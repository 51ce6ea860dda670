"""Expert parallel: the rows go by all-to-all to the ranks computing their expert, for a parallel degree r and
overlap degree d (chosen per step by the layer's tuner, parallel/tuner.py, or fixed).

r = 0: every rank gathers all experts' weights and computes its own tokens (the local dispatcher's path, no
token exchange). r >= 1: rows go by all-to-all to the ranks computing their expert (each of the r hidden
slices of it, partial outputs summed on return); weights are first gathered over the V = slices / r ranks
whose slices make one compute slice (parallel/expert_parallel.py). The rows are cut into d chunks: chunk c + 1
is in flight while chunk c is computed, and chunk c's results travel back while chunk c + 1 is computed.

The one host synchronization of the layer's forward is here, in route_counts: all-to-all needs the split
sizes (rows per destination rank, and per source rank on arrival) as host ints, so the gathered counts
counts_WE[w, e] are copied to the host once per forward. The degrees are chosen from them before any weight
is gathered. The local dispatcher has none.

With 2DH each exchange has two steps; chunk c + 2 starts its first step while chunk c + 1 runs its second
and chunk c is computed, so both steps overlap expert compute.

Shape legend: moe_plugin/__init__.py (here W ranks, counts_WE[w, e] the kept rows rank w routes to expert e,
V ranks gathered per compute slice).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import dispatch, ops
from ..experts import GroupedMLP
from ..parallel.all_to_all import Pending2DH, PendingAllToAll, ranges, segment_permutation
from ..parallel.expert_parallel import gathered_experts
from ..parallel.groups import ExpertGroups
from ..parallel.replicas import copy_weights, plan_copies, split_rows, worth_copying
from ..parallel.tuner import Tuner
from .base import Dispatcher
from .local import LocalDispatcher


def route_counts(plan: dispatch.Plan, group, device, extra: Optional[int] = None):
    """(counts_WE, extra_W): kept rows of every rank for every expert (one small all-gather), on the host:
    the all-to-all split sizes come from it (the layer's one host synchronization). extra: one host int
    per rank that rides on the same all-gather (the tuner's timings); extra_W is None without it."""
    mine_E = plan.kept_E.to(device=device, dtype=torch.long)
    if extra is not None:
        mine_E = torch.cat([mine_E, torch.tensor([extra], dtype=torch.long, device=device)])
    all_WE = mine_E.new_empty((dist.get_world_size(group),) + tuple(mine_E.shape))
    dist.all_gather(list(all_WE.unbind(0)), mine_E, group=group)
    all_WE = all_WE.cpu()
    return (all_WE, None) if extra is None else (all_WE[:, :-1], all_WE[:, -1])


def chunk_of(counts: torch.Tensor, d: int, c: int):
    """Sizes and offsets of chunk c when each count is cut into d near-equal parts."""
    base, extra = counts // d, counts % d
    size = base + (c < extra).long()
    offset = c * base + torch.clamp(extra, max=c)
    return size, offset


class AllToAllDispatcher(Dispatcher):
    """Expert parallel over groups.ep_group. tuner: a Tuner (the degrees follow each step's counts) or a
    OnceTuner (tuned once, or fixed); a2a: the configured exchange ("flat", "2dh" or "auto")."""

    priority = 10

    @classmethod
    def applies(cls, layer) -> bool:
        return layer.is_parallel

    @classmethod
    def build(cls, layer) -> "AllToAllDispatcher":
        return cls(layer.groups, layer.tuner, layer.config.a2a, layer.redundant_experts())

    def __init__(self, groups: ExpertGroups, tuner, a2a: str, redundant_experts=0):
        super().__init__(groups, tuner)
        self.a2a = a2a
        self.redundant_experts = redundant_experts     # "auto" with a Tuner: the tuner chooses R per load
        self.local = LocalDispatcher(groups)     # degree 0: every rank gathers all experts
        self.degrees = None         # (r, d, a2a) of the last call
        self.replicas: dict = {}    # the last call's copies (parallel/replicas.py), with redundant_experts > 0

    def __call__(self, x_TD, gate_TK, plan, experts, in_flight=None, parallel=None, overlap_degree=None,
                 training=False) -> torch.Tensor:
        tuning = parallel is None and overlap_degree is None and training and torch.is_grad_enabled()
        tuner = self.tuner
        if isinstance(tuner, Tuner):    # the setting follows this step's counts (gathered before any weight)
            counts_WE, times_W = route_counts(plan, self.groups.ep_group, x_TD.device, extra=tuner.outgoing())
            setting = tuner.choose(counts_WE, times_W, x_TD.dtype, measure=tuning,
                                   copies=lambda: self.copy_counts(counts_WE, experts, x_TD))
            r, d, a2a = setting[:3]
            copies = setting[3] if tuner.replicas else self.redundant_experts
            r = r if parallel is None else parallel
            d = d if overlap_degree is None else overlap_degree
            x_TD, gate_TK = tuner.enter(x_TD, gate_TK, experts.parameters())
            y_TD = tuner.leave(self.exchange(x_TD, gate_TK, plan, experts, r, d, a2a, in_flight, counts_WE,
                                             copies))
        else:
            r, d, a2a = tuner.current()
            a2a = a2a if self.a2a == "auto" else self.a2a
            r = r if parallel is None else parallel
            d = d if overlap_degree is None else overlap_degree
            with tuner.timed() as timer:
                y_TD = self.exchange(x_TD, gate_TK, plan, experts, r, d, a2a, in_flight)
            if tuning:
                tuner.record((r, d, a2a), timer.seconds)
        self.degrees = (r, d, a2a)
        return y_TD

    def copy_counts(self, counts_WE: torch.Tensor, experts, x_TD: torch.Tensor) -> List[int]:
        """The replica counts the tuner times at this load: the cost model's ("auto" per forward) and the one that
        levels the ranks (no traffic charged)."""
        layout = self.groups.layout
        total_E = counts_WE.sum(0).tolist()
        _, copy_rows = worth_copying("auto", experts.weights(x_TD.dtype), x_TD, layout.ep_size, self.groups.node_size)
        return [len(plan_copies(total_E, layout.local_experts, layout.ep_size, math.inf, rows))
                for rows in (copy_rows, 0.0)]

    def stats(self) -> dict:
        r, d, a2a = self.degrees
        return dict(parallel=r, overlap_degree=d, a2a=a2a, **self.replicas, **self.tuner.stats())

    def exchange(self, x_TD: torch.Tensor, gate_TK: torch.Tensor, plan: dispatch.Plan, experts, r: int, d: int,
                 a2a: str, in_flight=None, counts_WE: Optional[torch.Tensor] = None, copies=None) -> torch.Tensor:
        """The MoE at degrees (r, d, a2a). in_flight: a callable run once while the first all-to-all is in flight
        (before it, when r = 0). counts_WE: route_counts' when the caller has it already (to choose r, d and a2a
        from it). copies: the most replicas (default: redundant_experts; "auto": the cost model's per forward)."""
        copies = self.redundant_experts if copies is None else copies
        in_flight = in_flight or (lambda: None)
        groups = self.groups
        layout = groups.layout
        experts.check_degree(layout, r)
        weights = experts.weights(x_TD.dtype)
        if self.redundant_experts:
            self.replicas = {}
            if weights.has_lora:
                raise ValueError(f"MoEConfig.redundant_experts={self.redundant_experts} does not carry LoRA adapters: "
                                 f"set redundant_experts=0 for a layer with add_lora")
        if r == 0:
            weights = gathered_experts(weights, groups, r)
            in_flight()
            return self.local.run(x_TD, gate_TK, plan, experts, weights)   # no token exchange

        if counts_WE is None:
            counts_WE, _ = route_counts(plan, groups.ep_group, x_TD.device)
        weights = None if weights is None else gathered_experts(weights, groups, r)
        x_RD = dispatch.encode(x_TD, plan)[:int(counts_WE[layout.ep_rank].sum())]    # the kept rows
        split = None if not self.redundant_experts else \
            split_rows(counts_WE, layout.local_experts,
                       *worth_copying(copies, weights, x_TD, layout.ep_size, groups.node_size))
        if split is not None:
            self.replicas = dict(redundant_experts=copies, replicas=split.copies, replica_bytes=0,
                                 rank_rows=split.rank_rows(layout.ep_rank).tolist())
        if split is not None and split.copies:
            weights, self.replicas["replica_bytes"] = copy_weights(weights, split.copies, layout, groups.ep_group)
            chunks = [_slot_exchange(split, layout.ep_rank, d, c) for c in range(d)]
        else:       # no copy planned: the exchange of redundant_experts=0
            row_start_E = counts_WE[layout.ep_rank].cumsum(0) - counts_WE[layout.ep_rank]
            chunks = [_chunk_exchange(counts_WE, row_start_E, layout, r, d, c) for c in range(d)]

        def send(chunk):
            rows_RD = x_RD if chunk.sends_all_in_order else x_RD.index_select(0, chunk.send_index)
            return _start(rows_RD, chunk, groups, a2a)

        ahead = 2 if _two_step(groups, a2a) else 1     # chunks in flight ahead of the one computed
        pending, returns = [send(chunk) for chunk in chunks[:ahead]], []
        in_flight()
        for c, chunk in enumerate(chunks):
            if c + ahead < d:
                pending.append(send(chunks[c + ahead]))
            x_in_RD = pending[c].wait()
            if c + 1 < d:
                pending[c + 1].progress()
            if chunk.group_by_expert is not None:
                x_in_RD = x_in_RD.index_select(0, chunk.group_by_expert)
            if weights is None:       # experts without stacked weights: their own forward
                y_in_RD = experts(x_in_RD, chunk.rows_per_local_expert)
            else:
                offs_E = ops.offsets(chunk.rows_per_local_expert, device=x_in_RD.device)
                y_in_RD = GroupedMLP.apply(x_in_RD, offs_E, weights.activation,
                                           weights.w1_EDH, weights.b1_EH, weights.w2_EHD, weights.b2_ED,
                                           *weights.lora, weights.recompute)
            if chunk.group_by_expert is not None:
                y_in_RD = y_in_RD.index_select(0, chunk.ungroup)
            if returns:
                returns[-1].progress()
            returns.append(_start(y_in_RD, chunk.reversed(), groups, a2a))

        if len(chunks) == 1 and chunks[0].sends_all_in_order:
            y_RD = returns[0].wait()
        else:   # replicated rows (sliced experts) come back once per slice: their partial outputs add up
            y_RD = x_RD.new_zeros(x_RD.shape)
            for chunk, back in zip(chunks, returns):
                y_RD = y_RD.index_add(0, chunk.send_index, back.wait())
        return dispatch.decode(y_RD, gate_TK, plan)




class _ChunkExchange(SimpleNamespace):
    def reversed(self):
        return _ChunkExchange(send_counts=self.recv_counts, recv_counts=self.send_counts,
                              counts_WW=None if self.counts_WW is None else self.counts_WW.t().contiguous())


def _chunk_exchange(counts_WE, row_start_E, layout, r, d, c) -> _ChunkExchange:
    """Which of my rows go where in chunk c, and how the rows arriving here group by expert."""
    W, E = counts_WE.shape
    me = layout.ep_rank
    size_WE, offset_WE = chunk_of(counts_WE, d, c)
    slices, r_ = layout.slices, max(r, 1)
    if slices == 1:      # dst owns experts [dst * E_local, (dst + 1) * E_local): rows go in expert order
        counts_WW = size_WE.view(W, W, layout.local_experts).sum(2)
        seg_start, seg_size = row_start_E + offset_WE[me], size_WE[me]
    else:                # expert e's rows go to replica (src % V) of each of its r compute slices
        V = layout.gather_size(r_)
        counts_WW = torch.zeros(W, W, dtype=torch.long)
        replica_W1 = (torch.arange(W) % V)[:, None]
        for m in range(r_):
            counts_WW.scatter_add_(1, torch.arange(E) * slices + m * V + replica_W1, size_WE)
        seg_start = (row_start_E + offset_WE[me]).repeat_interleave(r_)     # (expert, m) = destination order
        seg_size = size_WE[me].repeat_interleave(r_)
    send_index = ranges(seg_start, seg_size)

    mine = slice(layout.first_expert, layout.first_expert + layout.local_experts)
    arriving_WE = size_WE[:, mine] if layout.slices == 1 else counts_WW[:, me:me + 1]   # [src, local expert]
    return _exchange(send_index, counts_WW, me, arriving_WE, sends_all_in_order=(d == 1 and layout.slices == 1))


def _slot_exchange(split, me: int, d: int, c: int) -> _ChunkExchange:
    """_chunk_exchange with replicas: my rows of each slot (parallel/replicas.py: each expert's owner and copies,
    in holder order) go to the slot's holder; the rows arriving here group by my slots."""
    W = split.counts_WJ.shape[0]
    size_WJ, offset_WJ = chunk_of(split.counts_WJ, d, c)
    counts_WW = torch.zeros(W, W, dtype=torch.long).index_add_(1, split.holder_J, size_WJ)
    send_index = ranges(split.start_WJ[me] + offset_WJ[me], size_WJ[me])
    mine = (split.holder_J == me).nonzero().view(-1)
    return _exchange(send_index, counts_WW, me, size_WJ[:, mine], sends_all_in_order=False)


def _exchange(send_index, counts_WW, me: int, arriving_WE, sends_all_in_order: bool) -> _ChunkExchange:
    """The exchange that sends my rows send_index by counts_WW; arriving_WE [src, my expert (or slot)]: the rows
    arriving here, which group by expert when I hold more than one."""
    group_by_expert = ungroup = None
    if arriving_WE.shape[1] > 1:
        group_by_expert = segment_permutation(arriving_WE)
        ungroup = torch.empty_like(group_by_expert)
        ungroup[group_by_expert] = torch.arange(group_by_expert.numel())
    return _ChunkExchange(send_index=send_index, send_counts=counts_WW[me].tolist(),
                          recv_counts=counts_WW[:, me].tolist(), counts_WW=counts_WW,
                          rows_per_local_expert=arriving_WE.sum(0).tolist(),
                          group_by_expert=group_by_expert, ungroup=ungroup, sends_all_in_order=sends_all_in_order)


def _two_step(groups: ExpertGroups, a2a: str) -> bool:
    """2DH runs as two steps only with several nodes of several ranks; otherwise it is the flat exchange."""
    return a2a == "2dh" and groups.node_size not in (1, groups.layout.ep_size)


def _start(rows_RD, chunk, groups: ExpertGroups, a2a: str):
    if _two_step(groups, a2a):
        return Pending2DH(rows_RD, chunk.counts_WW, groups.layout.ep_rank, groups.node_size,
                          groups.intra_node_group, groups.inter_node_group)
    return PendingAllToAll(rows_RD, chunk.send_counts, chunk.recv_counts, groups.ep_group)
