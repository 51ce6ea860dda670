"""Replicas of hot experts (MoEConfig.redundant_experts, issue 55): up to R extra copies of the busiest ranks'
hottest experts on the least-loaded ranks of the expert-parallel group; a replicated expert's rows are split
between its holders (its owner and its copies) so that the ranks even out.

Copies are not parameters. Each forward the owner's weights travel to the ranks holding a copy (copy_weights, one
all-to-all of the packed weights whose backward sends the copies' gradients back, added into the owner's), so state
dicts, optimizers and data-parallel hosts see only the owners' parameters and gradients.

The plan is made every forward from that forward's counts_WE, which every rank holds after the dispatcher's one
all-gather: every rank computes the same plan with no extra collective, and a new plan costs nothing (the copies'
weights travel every forward either way; nothing is stored).

Shape legend: moe_plugin/__init__.py (here J expert slots of the ep group: every expert's owner and each of its
copies, ordered by the rank holding them; Y the copies one rank sends or receives).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import torch

from ..experts import ExpertWeights
from . import cost_model
from .all_to_all import all_to_all

# a copy is planned only while the busiest rank has more than this times the mean rank's rows: a flat load's noise
# gets no copy (its traffic would buy next to nothing)
SLACK = 1.05
PASSES = 4      # rounds of levelling the replicated experts' holders (split_rows)


@dataclass
class Split:
    """Where the rows go this forward. copies: (expert, holder) sorted by (holder, expert). The slots of rank w are
    its own experts then the copies it holds; slot_expert_J and holder_J say whose rows a slot computes and where;
    counts_WJ[w, j] the rows rank w sends to slot j; start_WJ[w, j] where they start in rank w's rows (grouped by
    expert, as dispatch.encode lays them out)."""
    copies: List[Tuple[int, int]]
    slot_expert_J: torch.Tensor
    holder_J: torch.Tensor
    counts_WJ: torch.Tensor
    start_WJ: torch.Tensor

    def rank_rows(self, rank: int) -> torch.Tensor:
        """[W] the rows rank sends to each rank (its own rows included)."""
        W = self.counts_WJ.shape[0]
        return torch.zeros(W, dtype=torch.long).index_add_(0, self.holder_J, self.counts_WJ[rank])


def worth_copying(redundant_experts, weights: ExpertWeights, x_TD: torch.Tensor, ep_size: int,
                  node_size: int) -> Tuple[float, float]:
    """(most copies, what one copy costs in rows: plan_copies' copy_rows) for MoEConfig.redundant_experts: R -> (R, 0);
    "auto" -> (no limit, the rows whose expert compute and exchange (cost_model.row_seconds) cost what sending the
    copy's weights and bringing its gradients back does (cost_model.replica_seconds); NDM_A100_V4's rates on CUDA,
    GLOO_HERE's elsewhere)."""
    if redundant_experts != "auto":
        return redundant_experts, 0.0
    params = cost_model.NDM_A100_V4 if x_TD.is_cuda else cost_model.GLOO_HERE
    w1 = weights.w1_EDH
    matrices = 3 if w1.shape[2] > weights.w2_EHD.shape[1] else 2        # gated: w1 holds [gate | up]
    row = cost_model.row_seconds(w1.shape[1], weights.w2_EHD.shape[1], matrices, x_TD.element_size(), ep_size,
                                 node_size, params)
    nbytes = sum(t[0].numel() * t.element_size() for t in weights[:4] if t is not None)
    return math.inf, cost_model.replica_seconds(1, nbytes, ep_size, node_size, params) / row


def plan_copies(total_E: List[int], local_experts: int, ep_size: int, most: float,
                copy_rows: float = 0.0) -> List[Tuple[int, int]]:
    """Up to `most` (expert, holder) copies, greedily: the busiest rank's expert of the largest share gets a copy on
    the least-loaded rank not holding it, while that lowers the busiest rank (estimated with each expert's rows
    split evenly between its holders). Ties go to the lower expert or rank, so every rank plans alike.
    copy_rows > 0 ("auto": what one copy's traffic costs, in rows): the copies are kept while each lowers the cost
    of the busiest rank's rows after levelling (levelled) plus copy_rows per copy the busiest sender or receiver
    moves (busiest_copies)."""
    E, W = len(total_E), ep_size
    holders = [[e // local_experts] for e in range(E)]
    loads = [0.0] * W
    for e, rows in enumerate(total_E):
        loads[e // local_experts] += rows
    mean = sum(loads) / W
    copies: List[Tuple[int, int]] = []
    cost = max(loads)
    while len(copies) < most:
        busiest = max(range(W), key=lambda w: (loads[w], -w))
        if loads[busiest] <= SLACK * mean:
            break
        held = [e for e in range(E) if busiest in holders[e] and len(holders[e]) < W and total_E[e] > 0]
        if not held:
            break
        e = max(held, key=lambda e: (total_E[e] / len(holders[e]), -e))
        target = min((w for w in range(W) if w not in holders[e]), key=lambda w: (loads[w], w))
        old, new = total_E[e] / len(holders[e]), total_E[e] / (len(holders[e]) + 1)
        if max(loads[busiest] - (old - new), loads[target] + new) >= loads[busiest]:
            break
        holders[e].append(target)
        if copy_rows > 0:
            rows_W, _ = levelled(total_E, holders, local_experts, W)
            with_copy = max(rows_W) + copy_rows * busiest_copies(copies + [(e, target)], local_experts, W)
            if with_copy >= cost:
                holders[e].pop()
                break
            cost = with_copy
        for w in holders[e][:-1]:
            loads[w] += new - old
        loads[target] += new
        copies.append((e, target))
    return sorted(copies, key=lambda copy: (copy[1], copy[0]))


def busiest_copies(copies: List[Tuple[int, int]], local_experts: int, ep_size: int) -> int:
    """The most copies one rank sends (as an owner) or receives."""
    sent, received = [0] * ep_size, [0] * ep_size
    for e, holder in copies:
        sent[e // local_experts] += 1
        received[holder] += 1
    return max(sent + received, default=0)


def level(loads: List[int], rows: int) -> List[int]:
    """How many of `rows` each holder takes so that the holders' loads level off, lowest first (ints summing to
    rows; ties to the lower position)."""
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    take = [0] * len(loads)
    for n in range(1, len(order) + 1):
        total = rows + sum(loads[i] for i in order[:n])
        if n == len(order) or total // n <= loads[order[n]]:
            height, extra = divmod(total, n)
            for position, i in enumerate(order[:n]):
                take[i] = height - loads[i] + (position < extra)
            return take
    return take


def levelled(total_E: List[int], holders: List[List[int]], local_experts: int, ep_size: int) -> tuple:
    """(rows per rank, {(expert, holder): rows}): each replicated expert's rows shared out between its holders (owner
    first) so that their loads level off: in turn, the experts of most rows first, the others' shares held, PASSES
    rounds (all rows with the owners at first)."""
    loads = [0] * ep_size
    pieces = {}
    for e, rows in enumerate(total_E):
        loads[e // local_experts] += rows
        pieces.update({(e, h): rows if h == e // local_experts else 0 for h in holders[e]})
    replicated = sorted((e for e in range(len(total_E)) if len(holders[e]) > 1), key=lambda e: (-total_E[e], e))
    for _ in range(PASSES):
        for e in replicated:
            for h in holders[e]:
                loads[h] -= pieces[e, h]
            for h, rows in zip(holders[e], level([loads[h] for h in holders[e]], total_E[e])):
                loads[h] += rows
                pieces[e, h] = rows
    return loads, pieces


def split_rows(counts_WE: torch.Tensor, local_experts: int, most: float, copy_rows: float = 0.0) -> Split:
    """The plan for this forward's kept rows counts_WE [W, E] (the same on every rank): the copies (plan_copies), each
    replicated expert's rows levelled over its holders (levelled), and each rank's rows of an expert cut in rank order
    into the holders' pieces (owner first, then the copies by holder)."""
    W, E = counts_WE.shape
    total_E = counts_WE.sum(0).tolist()
    copies = plan_copies(total_E, local_experts, W, most, copy_rows)
    holders = [[e // local_experts] for e in range(E)]
    for e, h in copies:      # sorted by holder
        holders[e].append(h)
    replicated = [e for e in range(E) if len(holders[e]) > 1]
    _, pieces = levelled(total_E, holders, local_experts, W)

    slot_expert, holder = [], []
    for w in range(W):
        slot_expert += list(range(w * local_experts, (w + 1) * local_experts)) + [e for e, h in copies if h == w]
        holder += [w] * (local_experts + sum(h == w for _, h in copies))
    slot_expert_J, holder_J = torch.tensor(slot_expert), torch.tensor(holder)
    counts_WJ = counts_WE[:, slot_expert_J].clone()
    start_WJ = (counts_WE.cumsum(1) - counts_WE)[:, slot_expert_J].clone()
    slot_of = {(e, h): j for j, (e, h) in enumerate(zip(slot_expert, holder))}
    for e in replicated:
        ends_W = counts_WE[:, e].cumsum(0)           # each rank's rows of e, laid end to end in rank order
        begins_W, cut = ends_W - counts_WE[:, e], 0
        for h in holders[e]:
            j = slot_of[e, h]
            low, high = cut, cut + pieces[e, h]
            counts_WJ[:, j] = (torch.minimum(ends_W, torch.tensor(high)) -
                               torch.maximum(begins_W, torch.tensor(low))).clamp(min=0)
            start_WJ[:, j] += (torch.tensor(low) - begins_W).clamp(min=0).minimum(counts_WE[:, e])
            cut = high
    return Split(copies, slot_expert_J, holder_J, counts_WJ, start_WJ)


def copy_weights(weights: ExpertWeights, copies: List[Tuple[int, int]], layout, group) -> Tuple[ExpertWeights, int]:
    """(weights with the copies this rank holds appended after its own experts, in slot order; the bytes this rank
    sends). Differentiable: the copies' gradients go back to their owners and add into the owners' gradients."""
    assert not weights.has_lora, "the dispatcher refuses LoRA with replicas"
    W, me, first = layout.ep_size, layout.ep_rank, layout.first_expert
    owner = [e // layout.local_experts for e, _ in copies]
    sent = [e - first for (e, _), o in zip(copies, owner) if o == me]         # sorted by holder: the send order
    send_counts = [sum(o == me and h == w for (_, h), o in zip(copies, owner)) for w in range(W)]
    recv_counts = [sum(o == w and h == me for (_, h), o in zip(copies, owner)) for w in range(W)]
    stacks = [t for t in weights[:4] if t is not None]
    index = torch.tensor(sent, dtype=torch.long, device=stacks[0].device)
    packed_Y = torch.cat([t.index_select(0, index).flatten(1) for t in stacks], 1)
    got_Y = all_to_all(packed_Y, send_counts, recv_counts, group)
    widths = [t[0].numel() for t in stacks]
    parts = iter(torch.cat([t, part.view((-1,) + tuple(t.shape[1:]))], 0)
                 for t, part in zip(stacks, got_Y.split(widths, 1)))
    joined = [None if t is None else next(parts) for t in weights[:4]]
    return weights._replace(w1_EDH=joined[0], b1_EH=joined[1], w2_EHD=joined[2], b2_ED=joined[3]), \
        packed_Y.numel() * packed_Y.element_size()
