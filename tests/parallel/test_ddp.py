"""ddp_moe (DistributedDataParallel for expert-parallel models) on 2 gloo processes against one process training on
every rank's batch, and plain DDP around an expert-parallel layer caught at its first forward.

What this module tests (moved here from the README):

Tested in
`tests/parallel/test_ddp.py` (2 processes, ep_size 2: fp64 losses over 3 SGD steps equal one process on
both ranks' batches; plain DDP caught; plain DDP at ep_size 1 runs).
"""
import pytest
import torch

from moe_plugin.parallel import ddp_moe

from helpers.launch import run_workers
from helpers.sgd_steps import B, S, STEPS, V, build, reference_losses, sgd_error, step_loss


def _ddp_cases(rank, world, seed):
    """(worst relative loss error of ddp_moe at ep_size 2 against one process, how far the reference losses moved,
    plain DDP's error at ep_size 2 (None if none), plain DDP's at ep_size 1)."""
    spec = dict(seed=seed, E=4, H=8, activation="swiglu", bias=True, layers=2)
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [[(torch.randint(V, (B, S), generator=generator), torch.randint(V, (B, S), generator=generator))
                for _ in range(world)] for _ in range(STEPS)]
    want = reference_losses(spec, batches, world)
    error, moved = sgd_error(ddp_moe(build(seed, world, 4, 8, "swiglu", True, 2)), batches, rank, world, want)
    plain = []
    for ep_size in (world, 1):
        try:
            step_loss(torch.nn.parallel.DistributedDataParallel(build(seed, ep_size, 4, 8, "swiglu", True, 2)),
                      *batches[0][rank])
            plain.append(None)
        except ValueError as problem:
            plain.append(str(problem))
    return error, moved, *plain


@pytest.mark.slow
def test_ddp_moe_trains_as_one_process_and_plain_ddp_is_caught(fresh_seed):
    """ddp_moe at ep_size 2: fp64 losses over 3 SGD steps equal one process on both ranks' batches; a plain
    DistributedDataParallel around the same model fails at its first forward naming ddp_moe (it would have
    broadcast rank 0's experts); at ep_size 1 plain DDP runs."""
    for error, moved, plain_ep2, plain_ep1 in run_workers(_ddp_cases, 2, fresh_seed, timeout=200):
        assert moved > 1e-3, "the optimizer steps must change the losses, or the test could not fail"
        assert error < 1e-10, error
        assert plain_ep2 is not None and "ddp_moe" in plain_ep2 and "ep_size=2" in plain_ep2, plain_ep2
        assert plain_ep1 is None, plain_ep1
