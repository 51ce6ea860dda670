"""Differentiable collectives for expert parallelism: variable-size all-to-all (flat and
2D-hierarchical, blocking or started/waited for overlap) and an all-gather whose backward sums.

Shape legend: moe_plugin/__init__.py (here W ranks in the group, L ranks per node, U = W / L nodes, D row width,
counts_WW[src, dst] the rows rank src sends to rank dst, Z segments, V the ranks of a gather).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


def ranges(start_Z: torch.Tensor, size_Z: torch.Tensor) -> torch.Tensor:
    """cat(arange(start, start + size) for each segment), without a Python loop."""
    segment_R = torch.repeat_interleave(torch.arange(size_Z.numel()), size_Z)
    first_R = (size_Z.cumsum(0) - size_Z)[segment_R]
    return start_Z[segment_R] + torch.arange(segment_R.numel()) - first_R


def segment_permutation(sizes: torch.Tensor) -> torch.Tensor:
    """Rows laid out as segments of sizes [a, b] in a-major order; the index that lists them in b-major order."""
    flat_sizes = sizes.reshape(-1)
    starts = (flat_sizes.cumsum(0) - flat_sizes).view(sizes.shape)
    return ranges(starts.t().reshape(-1), sizes.t().reshape(-1))


class _Exchange:
    """One started all-to-all: its handle and, in backward, the reverse exchange's handle."""

    def __init__(self, send_counts: List[int], recv_counts: List[int], group):
        self.send_counts, self.recv_counts, self.group = send_counts, recv_counts, group
        self.handle = self.grad_handle = self.grad_input = None

    def start(self, input_RD: torch.Tensor) -> torch.Tensor:
        output_RD = input_RD.new_empty(sum(self.recv_counts), input_RD.shape[1])
        self.handle = dist.all_to_all_single(output_RD, input_RD.contiguous(), self.recv_counts,
                                             self.send_counts, group=self.group, async_op=True)
        return output_RD

    def start_reverse(self, grad_output_RD: torch.Tensor) -> None:
        self.grad_input = grad_output_RD.new_empty(sum(self.send_counts), grad_output_RD.shape[1])
        self.grad_handle = dist.all_to_all_single(self.grad_input, grad_output_RD.contiguous(), self.send_counts,
                                                  self.recv_counts, group=self.group, async_op=True)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_RD, exchange):
        ctx.exchange = exchange
        return exchange.start(input_RD)

    @staticmethod
    def backward(ctx, _grad_ignored):
        exchange = ctx.exchange
        exchange.grad_handle.wait()
        grad_input, exchange.grad_handle, exchange.grad_input = exchange.grad_input, None, None
        return grad_input, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output_RD, exchange):
        exchange.handle.wait()
        exchange.handle = None   # the work holds the output tensor, which holds this graph: no cycle
        ctx.exchange = exchange
        return output_RD.view_as(output_RD)

    @staticmethod
    def backward(ctx, grad_RD):
        ctx.exchange.start_reverse(grad_RD)
        return grad_RD, None


class PendingAllToAll:
    """all_to_all_single started now, waited for later; autograd runs the reverse exchange."""
    stages = 1

    def __init__(self, input_RD: torch.Tensor, send_counts: List[int], recv_counts: List[int], group):
        self.exchange = _Exchange(list(send_counts), list(recv_counts), group)
        self.output_RD = _Start.apply(input_RD, self.exchange)

    def progress(self) -> None:
        """Nothing to move on: the one exchange is in flight."""

    def wait(self) -> torch.Tensor:
        return _Wait.apply(self.output_RD, self.exchange)


def all_to_all(input_RD: torch.Tensor, send_counts: List[int], recv_counts: List[int], group) -> torch.Tensor:
    return PendingAllToAll(input_RD, send_counts, recv_counts, group).wait()


class Pending2DH:
    """The flat exchange done in two steps: inside the node (grouped by destination's local index),
    then across nodes. Input rows are ordered by destination rank, output rows by source rank,
    exactly as the flat all-to-all orders them. Step 1 starts now; progress() waits for it and starts
    step 2; wait() returns the rows. Each step is a PendingAllToAll, so backward overlaps as flat does."""
    stages = 2

    def __init__(self, input_RD: torch.Tensor, counts_WW: torch.Tensor, rank: int, node_size: int,
                 intra_group, inter_group):
        W, L = counts_WW.shape[0], node_size
        U = W // L
        node, local = divmod(rank, L)
        counts_ULUL = counts_WW.view(U, L, U, L)
        # step 1: my rows, (dst node, dst local) order -> (dst local, dst node), sent to local peers
        mine_UL = counts_ULUL[node, local]                                   # [dst node, dst local]
        step1_in = input_RD.index_select(0, segment_permutation(mine_UL))
        self.arriving_LU = counts_ULUL[node, :, :, local]                    # [src local, dst node]
        self.step1 = PendingAllToAll(step1_in, mine_UL.sum(0).tolist(), self.arriving_LU.sum(1).tolist(),
                                     intra_group)
        self.step2_recv = counts_ULUL[:, :, node, local].sum(1).tolist()     # per src node
        self.inter_group, self.step2 = inter_group, None

    def progress(self) -> None:
        if self.step2 is None:   # step 2: (src local, dst node) -> (dst node, src local), across nodes
            step2_in = self.step1.wait().index_select(0, segment_permutation(self.arriving_LU))
            self.step2 = PendingAllToAll(step2_in, self.arriving_LU.sum(0).tolist(), self.step2_recv,
                                         self.inter_group)

    def wait(self) -> torch.Tensor:
        self.progress()
        return self.step2.wait()


def all_to_all_2dh(input_RD: torch.Tensor, counts_WW: torch.Tensor, rank: int, node_size: int,
                   intra_group, inter_group) -> torch.Tensor:
    return Pending2DH(input_RD, counts_WW, rank, node_size, intra_group, inter_group).wait()


class _GatherSum(torch.autograd.Function):
    """forward: all-gather into [V, *shape]; backward: sum the gradients over the group, keep mine."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = tensor.new_empty((size,) + tuple(tensor.shape))
        dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad_V):
        grad_V = grad_V.contiguous()
        dist.all_reduce(grad_V, group=ctx.group)
        return grad_V[dist.get_rank(ctx.group)].clone(), None


def gather_sum(tensor: Optional[torch.Tensor], group) -> Optional[torch.Tensor]:
    if tensor is None:
        return None
    if group is None:
        return tensor.unsqueeze(0)
    return _GatherSum.apply(tensor, group)
