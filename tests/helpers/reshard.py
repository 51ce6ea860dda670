"""`moe-plugin train`'s parts run a few steps and save (the whole state gathered as the reference), then restore
in another layout and compare every tensor with this rank's share of the reference: shared by the resharding
tests of tests/train."""
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from moe_plugin import aux_loss, train, update_expert_bias
from moe_plugin.experts import Experts
from moe_plugin.parallel.expert_grads import expert_layers
from moe_plugin.parallel.expert_parallel import gathered_experts
from moe_plugin.train.checkpoint import whole
from moe_plugin.train.data import make_data

TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=16", "model.ffn_hidden=48",
        "moe.hidden_size=24", "moe.num_experts=4", "train.batch_size=3", "train.eval_batches=1",
        "train.warmup_steps=2", "train.steps=10", "log.progress=false", "moe.gate_noise=0.5"]
MOMENTS = ("exp_avg", "exp_avg_sq")
SHORT = {"w1_EDH": "w1", "b1_EH": "b1", "w2_EHD": "w2", "b2_ED": "b2"}


def _parts(rank, world_size, overrides):
    cfg = train.load_config(None, [*TINY, *overrides])
    procs = train.Processes(rank, world_size, torch.device("cpu"), False)
    return cfg, procs, train.build(cfg, procs)


def train_and_save(rank, world_size, overrides, out, steps):
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


def restore_and_compare(rank, world_size, overrides, path, reference):
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
