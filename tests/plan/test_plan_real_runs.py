"""`moe-plugin plan` against real runs of the same experiment on 2 and 4 gloo processes (and an hf section's
Mixtral on 2).

Each rank of a real run (train/parts.py's build, DDP or FSDP2 as `moe-plugin train` wraps it) takes one training
step; the plan's role for that rank must hold exactly the memory of the rank's parameters and gradients (their
storages, each once: under DDP the buckets the gradients are views into and the experts' own gradients, so that a
bucket copying the gradients would show; under FSDP2 each shard as FSDP2 pads it) and of AdamW's state, and its
all-reduce, reduce-scatter and all-gather bytes must be exactly what the rank handed to those collectives (DDP's buckets and the experts' hooks, FSDP2's gradients and parameters). At a
capacity every expert fills (capacity_factor 0.1: 7 rows per expert against ~64 routed to each; the worker checks
that every slot was filled) the real all-to-all bytes are fixed: the plan's must be exactly what each rank handed
to all_to_all_single (sent) and got back (received). Where no row is dropped (capacity_factor 2.0, or dropless),
as the plan assumes, its activations must be within 10% of the bytes the real forward saved for backward (under
DDP: FSDP2's forward saves the gathered weights, which it frees, so its saved bytes are not activations), with
MoEConfig.recompute "none" and "experts".
"""
import os

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from moe_plugin import aux_loss, train
from moe_plugin.plan import plan_experiment
from moe_plugin.plan.devices import device
from moe_plugin.plan.state_bytes import local_part, nbytes, saved_for_backward, storage_key
from moe_plugin.train.parts import build, data_parallel
from moe_plugin.train.processes import start_processes

from helpers.hf import needs_transformers
from helpers.launch import run_workers
from helpers.paths import REPO

TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.hidden_size=48", "moe.num_experts=4", "train.batch_size=4", "train.eval_batches=1"]
FULL, KEPT = "moe.capacity_factor=0.1", "moe.capacity_factor=2.0"     # every expert full; every row kept
MIXTRAL = [str(REPO / "configs/experiments/mixtral_tiny.yaml"), "hf.hidden_size=32", "hf.intermediate_size=48",
           "hf.num_local_experts=4", "model.seq_len=32", "train.batch_size=4", "train.eval_batches=1",
           "parallel.ep_size=2"]
# the runs each real worker takes in turn: (config file or None, overrides)
RUNS = {2: [(None, [*TINY, FULL, "parallel.ep_size=2"]), (None, [*TINY, FULL, "parallel.ep_size=2",
                                                                  "parallel.fsdp=true"]),
            (None, [*TINY, KEPT]), (None, [*TINY, KEPT, "parallel.ep_size=2"]),
            (None, [*TINY, KEPT, "parallel.ep_size=2", "moe.recompute=experts"])],
        4: [(None, [*TINY, FULL, "parallel.ep_size=4"]),        # 30 positions: FSDP2 pads them to 4 x 8 rows
            (None, [*TINY, FULL, "model.seq_len=30", "parallel.ep_size=2", "parallel.fsdp=true"]),
            (None, [*TINY, KEPT, "parallel.ep_size=4"]),
            (None, [*TINY, FULL, "parallel.ep_size=2"])],       # experts' gradients all-reduced over 2 holders
        "hf": [(MIXTRAL[0], [*MIXTRAL[1:], FULL]), (MIXTRAL[0], MIXTRAL[1:]),     # mixtral_tiny: dropless
               (MIXTRAL[0], [*MIXTRAL[1:-1], "parallel.ep_size=1"])]}


# the collectives counted: dist's function -> (what it adds to, the bytes of its call)
COUNTED = {"all_to_all_single": [("sent", lambda output, input, *_, **__: input),
                                 ("received", lambda output, input, *_, **__: output)],
           "all_reduce": [("all_reduce", lambda tensor, *_, **__: tensor)],
           "reduce_scatter_single": [("reduce_scatter", lambda output, input, *_, **__: input)],     # FSDP2's
           "all_gather_single": [("all_gather", lambda output_tensor, *_, **__: output_tensor)]}


def _one_step(cfg, procs):
    """One training step of the run; what the rank held, sent and saved for backward."""
    parts = build(cfg, procs)
    model, wrapped = parts.model, data_parallel(parts.model, procs)
    moved = {key: 0 for counts in COUNTED.values() for key, _ in counts}
    buckets = []
    if isinstance(wrapped, DistributedDataParallel):     # DDP's own all-reduce of each bucket, through dist's

        def all_reduce_bucket(group, bucket):
            buckets.append(bucket.buffer())
            return allreduce_hook(group, bucket)
        wrapped.register_comm_hook(None, all_reduce_bucket)
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name):
        def collective(*args, **kwargs):
            for key, tensor in COUNTED[name]:
                moved[key] += nbytes(tensor(*args, **kwargs))
            return originals[name](*args, **kwargs)
        return collective
    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        x_BS, y_BS = parts.data.train.next()
        saved = {}
        with saved_for_backward(model, saved):
            logits_BSV = wrapped(x_BS)
            loss = F.cross_entropy(logits_BSV.flatten(0, -2), y_BS.flatten())
        (loss + aux_loss(model)).backward()
        parts.optimizer.step()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    grads = [local_part(p.grad) for p in model.parameters() if p.grad is not None]
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in [*buckets, *grads]}   # each once
    parameters = {storage_key(t): t.untyped_storage().nbytes() for t in map(local_part, model.parameters())}
    return {"parameter_storage": sum(parameters.values()), "gradient_storage": sum(storages.values()),
            "optimizer": sum(nbytes(t) for state in parts.optimizer.state.values() for t in state.values()),
            "activations": saved["bytes"], "slots_filled": [m.stats["capacity_used"] for m in model.moe_layers()],
            **moved}


def _worker(rank, world, runs):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    procs = start_processes("cpu")
    return [_one_step(train.load_config(path, overrides), procs) for path, overrides in RUNS[runs]]


@pytest.mark.slow
@pytest.mark.parametrize("world, runs", [(2, 2), (4, 4), pytest.param(2, "hf", marks=needs_transformers)])
def test_plan_equals_what_real_ranks_hold_and_send(world, runs):
    real = run_workers(_worker, world, runs, timeout=240)
    for run, (path, overrides) in enumerate(RUNS[runs]):
        cfg = train.load_config(path, overrides)
        plan = plan_experiment(cfg, world, world, device("cpu"))
        assert sorted(r for role in plan.roles for r in role.ranks) == list(range(world))
        for role in plan.roles:
            for rank in role.ranks:
                held, where = real[rank][run], f"{overrides[-3:]} rank {rank}"
                assert (role.parameters_bytes, role.gradients_bytes, role.optimizer_bytes) == \
                    (held["parameter_storage"], held["gradient_storage"], held["optimizer"]), where
                assert (role.all_reduce_bytes, role.reduce_scatter_bytes, role.all_gather_bytes) == \
                    (held["all_reduce"], held["reduce_scatter"], held["all_gather"]), where
                if FULL in overrides:
                    assert held["slots_filled"] == [1.0] * len(plan.layers), where    # the count's precondition
                    assert role.all_to_all_bytes == held["sent"] == held["received"], where
                elif not cfg.parallel.fsdp:
                    assert abs(role.activations_bytes / held["activations"] - 1) < 0.10, \
                        (where, role.activations_bytes, held["activations"])
