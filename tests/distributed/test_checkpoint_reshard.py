"""Sharded checkpoints of `moe-plugin train` resume on another number of processes and/or ep_size.

A run in one layout trains a few steps and saves; its whole state (every expert gathered by the
expert-parallel gather path, and AdamW's moments gathered alike) is the reference. A run in another
layout restores the checkpoint; on every rank each tensor of the model and of the optimizer must
equal the share of the reference that this rank holds (Experts.take_slice, the layer's own rule),
bit for bit, and the LR schedule, the steps and the data position must be where the rule puts them.
"""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from launch import run_workers
from moe_plugin import aux_loss, train, update_expert_bias
from moe_plugin.train.data import make_data
from moe_plugin.experts import Experts
from moe_plugin.parallel.expert_grads import expert_layers
from moe_plugin.parallel.expert_parallel import gathered_experts
from moe_plugin.train.checkpoint import whole

TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=16", "model.ffn_hidden=48",
        "moe.hidden_size=24", "moe.num_experts=4", "train.batch_size=3", "train.eval_batches=1",
        "train.warmup_steps=2", "train.steps=10", "log.progress=false", "moe.gate_noise=0.5"]
MOMENTS = ("exp_avg", "exp_avg_sq")
SHORT = {"w1_EDH": "w1", "b1_EH": "b1", "w2_EHD": "w2", "b2_ED": "b2"}


def _parts(rank, world_size, overrides):
    cfg = train.load_config(None, [*TINY, *overrides])
    procs = train.Processes(rank, world_size, torch.device("cpu"), False)
    return cfg, procs, train.build(cfg, procs)


def _train_and_save(rank, world_size, overrides, out, steps):
    """`steps` training steps as the trainer takes them, a checkpoint, and the whole state (on every rank;
    gathered from the shards under parallel.fsdp)."""
    cfg, procs, parts = _parts(rank, world_size, overrides)
    model = parts.model
    wrapped = train.data_parallel(model, procs)
    for _ in range(steps):
        x_BS, y_BS = parts.data.train.next()
        loss = F.cross_entropy(wrapped(x_BS).flatten(0, 1), y_BS.flatten()) + aux_loss(model)
        parts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        train.clip_gradients(model, cfg.train.grad_clip, procs, cfg.parallel.ep_size)
        parts.optimizer.step()
        update_expert_bias(model)
        parts.scheduler.step()
    train.save(parts, procs, cfg, Path(out), steps, train.Window())

    full = {"model": train.full_state_dict(model)}
    names = {id(p): n for n, p in model.named_parameters()}
    for key in MOMENTS + ("step",):
        full[key] = {names[id(p)]: whole(parts.optimizer.state[p][key]).clone() for p in model.parameters()}
    for prefix, layer in expert_layers(model):
        for key in MOMENTS:
            local = {n: full[key].get(f"{prefix}experts.{n}") for n in SHORT}
            gathered = gathered_experts(SimpleNamespace(activation=layer.experts.activation, **local), layer.groups, 0)
            full[key].update({f"{prefix}experts.{n}": getattr(gathered, n) for n in SHORT if local[n] is not None})
    full["lr"] = [group["lr"] for group in parts.optimizer.param_groups]
    if rank == 0:   # tensors cannot come back through the launcher's queue once the worker is gone
        torch.save(full, Path(out) / "reference.pt")


def _share(full_by_name, name, layout):
    """This rank's part of a whole expert tensor, cut by the layer's own rule."""
    first, count = layout.first_expert, layout.local_experts
    shards = [Experts.take_slice({SHORT[n]: t[e] for n, t in full_by_name.items()}, layout.slices, layout.slice_index)
              for e in range(first, first + count)]
    return torch.stack([shard[SHORT[name]] for shard in shards])


def _restore_and_compare(rank, world_size, overrides, path, reference):
    full = torch.load(reference, weights_only=True)
    cfg, procs, parts = _parts(rank, world_size, overrides)
    step, window = train.restore(parts, procs, cfg, Path(path))
    model = parts.model
    layers = {prefix: layer for prefix, layer in expert_layers(model)}
    errors = []

    def expect(name, got, want_by_name):
        prefix, _, short = name.rpartition("experts.")
        if prefix in layers:
            want = _share({n: want_by_name[f"{prefix}experts.{n}"] for n in SHORT
                           if f"{prefix}experts.{n}" in want_by_name}, short, layers[prefix].groups.layout)
        else:
            want = want_by_name[name]
        if not torch.equal(whole(got), want):
            errors.append(name)

    for name, tensor in model.state_dict().items():
        expect(name, tensor, full["model"])
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        for key in MOMENTS:
            expect(names[id(p)], parts.optimizer.state[p][key], full[key])
        if not torch.equal(parts.optimizer.state[p]["step"], full["step"][names[id(p)]]):
            errors.append(f"step of {names[id(p)]}")
    lr = [group["lr"] for group in parts.optimizer.param_groups]
    # the data rule: this rank reads batch step + 1 of its own stream for this number of processes
    fresh = make_data(cfg.data, cfg.train.batch_size, cfg.model.seq_len, 1, rank, world_size).train
    for _ in range(step):
        fresh.next()
    data_ok = torch.equal(parts.data.train.next()[0], fresh.next()[0])
    return {"step": step, "errors": errors, "lr": lr, "data_ok": data_ok, "window_steps": window.steps,
            "experts_here": sum(1 for _ in layers), "checked": len(model.state_dict())}


MOVES = {
    "2 processes ep 2 -> 1 process": ((2, ["parallel.ep_size=2"]), (1, [])),
    "1 process -> 2 processes ep 2": ((1, []), (2, ["parallel.ep_size=2"])),
    "4 processes ep 2 -> 2 processes ep 2": ((4, ["parallel.ep_size=2"]), (2, ["parallel.ep_size=2"])),
    "4 processes ep 4 -> 4 processes ep 2": ((4, ["parallel.ep_size=4"]), (4, ["parallel.ep_size=2"])),
    # hidden-sliced swiglu experts with biases (2 experts on 4 ranks: 2 slices each) -> whole experts, and back
    "sliced swiglu ep 4 -> 2 processes ep 2": ((4, ["parallel.ep_size=4", "moe.num_experts=2", "moe.top_k=1",
                                                    "moe.activation=swiglu", "moe.bias=true"]),
                                               (2, ["parallel.ep_size=2", "moe.num_experts=2", "moe.top_k=1",
                                                    "moe.activation=swiglu", "moe.bias=true"])),
    # a shared expert (replicated) and the auxiliary-loss-free router bias (a buffer, the same on every rank)
    "shared expert and router bias, 2 processes ep 2 -> 1 process": (
        (2, ["parallel.ep_size=2", "moe.shared_hidden_size=16", "moe.expert_bias_update_rate=0.01"]),
        (1, ["moe.shared_hidden_size=16", "moe.expert_bias_update_rate=0.01"])),
    "1 process -> sliced swiglu ep 4": ((1, ["moe.num_experts=2", "moe.top_k=1", "moe.activation=swiglu"]),
                                        (4, ["parallel.ep_size=4", "moe.num_experts=2", "moe.top_k=1",
                                             "moe.activation=swiglu"])),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("move", list(MOVES))
def test_resume_in_another_layout_restores_every_tensor_exactly(tmp_path, fresh_seed, move):
    (src_world, src), (dst_world, dst) = MOVES[move]
    seed = [f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    run_workers(_train_and_save, src_world, [*src, *seed], str(tmp_path), 3, timeout=200)
    path, reference = tmp_path / "checkpoints" / "step_000003", tmp_path / "reference.pt"
    results = run_workers(_restore_and_compare, dst_world, [*dst, *seed], str(path), str(reference), timeout=200)
    full = torch.load(reference, weights_only=True)
    for rank, result in enumerate(results):
        assert result["errors"] == [], (rank, result["errors"])
        assert result["step"] == 3 and result["lr"] == full["lr"]
        assert result["data_ok"], rank
        assert result["window_steps"] == 0
        assert result["checked"] > 10
    if "router bias" in move:
        bias = [v for k, v in full["model"].items() if k.endswith("router.expert_bias_E")]
        assert bias and all(float(b.abs().max()) > 0 for b in bias)   # it moved, and came back exactly
    if dst_world > 1:
        assert results[0]["experts_here"] >= 1   # the MoE layer really is expert-parallel after the move
