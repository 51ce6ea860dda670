"""FSDP2 (fully_shard_moe) on 2 and 4 gloo processes against one process training on every rank's batch.

The one-process reference is the same TransformerLM holding every expert, whose loss is the mean of the
ranks' losses (what DDP and FSDP compute). A wrong expert gradient scale, or experts gathered across
ranks that hold different experts, changes the losses after the first step by far more than fp32 noise.
What this module tests (moved here from the README):

What is tested (gloo, CPU): `tests/parallel/test_fsdp.py` (2 and 4 processes; ep_size 1, 2, and 4 with
hidden-sliced experts; activation checkpointing; bf16 parameters with fp32 reduction; each rank routing no
token to 4 of 8 experts; fp64 losses over 3 SGD steps equal one process training on all ranks' batches; the
FSDP units are exactly the blocks and the root; the separate-unit path of older torch, at ep 2 and sliced ep 4;
plain `fully_shard` detected; an already sharded model, a 2-D mesh and a layer built with a host's `ep_group`
refused with a ValueError; torch's state-dict API at ep_size 2 on 2 and 4 processes, the 4 with uneven splits
(3 experts over 2 holders): a sharded DCP save after 2 AdamW steps loads back exactly into a fresh model, every
parameter and optimizer state, each rank's own shards and the next step's loss, also into ep_size 1, and a full
state dict loads back exactly; sliced experts' sharded state dict refused);
"""
import pytest
import torch
import torch.distributed as dist

from moe_plugin.parallel import fsdp, fully_shard_moe

from helpers.launch import run_workers
from helpers.sgd_steps import B, S, STEPS, V, build, reference_losses, sgd_error, step_loss


def _train_sharded(rank, world, spec):
    """(worst relative loss error against one process, how far the reference losses moved, the names of the
    modules that are FSDP units)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    generator = torch.Generator().manual_seed(spec["seed"] + 1)
    shape = spec.get("tokens", (B, S))
    batches = [[(torch.randint(V, shape, generator=generator), torch.randint(V, shape, generator=generator))
                for _ in range(world)] for _ in range(STEPS)]
    want = reference_losses(spec, batches, world)
    model = build(spec["seed"], spec["ep"], spec["E"], spec["H"], spec["activation"], spec["bias"], spec["layers"],
                  spec.get("recompute", "none"))
    if spec.get("checkpointing"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if spec.get("bf16") else None
    per_parameter_mesh = fsdp.ShardPlacementResult
    if spec.get("apart"):   # the path for a torch without per-parameter meshes
        fsdp.ShardPlacementResult = None
    try:
        fully_shard_moe(model, mp_policy=policy)
    finally:
        fsdp.ShardPlacementResult = per_parameter_mesh
    units = sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))
    return (*sgd_error(model, batches, rank, world, want), units)


def _plain_fully_shard(rank, world):
    from torch.distributed.fsdp import fully_shard
    model = build(0, world, 4, 8, "gelu", True, 2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    try:
        model(torch.randint(V, (B, S)))
    except ValueError as error:
        return str(error)
    return None


def _refusals(rank, world):
    """fully_shard_moe's ValueError messages for: a model sharded already, a 2-D mesh, a layer built with a host's
    ep_group (it does not know its expert-data group); None where the call worked: torch's API at ep_size 1, its
    full state dict at ep_size 2 (every expert: those of one process building the model from the same seed), and
    moe_plugin.checkpoint's save and load at ep_size 2 (its experts come back exactly)."""
    import tempfile

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from moe_plugin import MoELayer, checkpoint
    expert_parallel = fully_shard_moe(build(0, world, 4, 8, "gelu", True, 2))
    path = tempfile.mkdtemp() if rank == 0 else None
    box = [path]
    dist.broadcast_object_list(box)

    def own_checkpoint_round_trip():
        checkpoint.save(checkpoint.sharded_state(expert_parallel), box[0])
        fresh = fully_shard_moe(build(5, world, 4, 8, "gelu", True, 2))
        checkpoint.load(checkpoint.sharded_state(fresh, writing=False), box[0])
        for (name, p), q in zip(expert_parallel.named_parameters(), fresh.parameters()):
            if not torch.equal(p.to_local(), q.to_local()):
                raise AssertionError(f"moe_plugin.checkpoint did not restore {name}")

    def full_state_has_every_expert():
        full = get_model_state_dict(expert_parallel, options=StateDictOptions(full_state_dict=True))
        for name, tensor in build(0, 1, 4, 8, "gelu", True, 2).state_dict().items():
            if not torch.equal(full[name], tensor):
                raise AssertionError(f"the full state dict's {name} is not one process's")

    cases = [lambda: fully_shard_moe(fully_shard_moe(build(0, 1, 4, 8, "gelu", True, 2))),
             lambda: fully_shard_moe(build(0, 1, 4, 8, "gelu", True, 2), mesh=init_device_mesh("cpu", (1, world))),
             lambda: fully_shard_moe(MoELayer(dict(model_dim=8, hidden_size=8, num_experts=4, ep_size=world),
                                              ep_group=dist.group.WORLD)),
             lambda: get_model_state_dict(fully_shard_moe(build(0, 1, 4, 8, "gelu", True, 2))),
             full_state_has_every_expert if rank == 0 else lambda: get_model_state_dict(
                 expert_parallel, options=StateDictOptions(full_state_dict=True)),
             own_checkpoint_round_trip]
    messages = []
    for case in cases:
        try:
            case()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def _full_state_error(rank, world, ep, E):
    """On rank 0, how far torch's full state dict (full_state_dict=True, what HF Trainer's save_model gathers) of a
    model sharded by fully_shard_moe is from one process's model built from the same seed (None elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    model = fully_shard_moe(build(0, ep, E, 8, "swiglu", True, 2))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    try:
        get_model_state_dict(model)
        refused = None
    except ValueError as error:
        refused = str(error)
    if rank != 0:
        return None, refused
    want = build(0, 1, E, 8, "swiglu", True, 2).state_dict()
    assert sorted(full) == sorted(want), (sorted(full), sorted(want))
    return max((full[name] - tensor).abs().max().item() for name, tensor in want.items()), refused


def _train_cases(rank, world, seed, specs):
    results = [_train_sharded(rank, world, dict(spec, seed=seed + i)) for i, spec in enumerate(specs)]
    if world == 2:
        return results + [_plain_fully_shard(rank, world), _refusals(rank, world)]
    return results + [_full_state_error(rank, world, ep=4, E=2)]   # hidden-sliced experts


BASE = dict(E=4, H=8, activation="swiglu", bias=True, layers=2)
CASES = {  # world: specs; the tolerance is fp64's, except under bf16 parameters
    2: [dict(BASE, ep=1, activation="gelu"), dict(BASE, ep=2, bias=False),
        dict(BASE, ep=2, layers=4, checkpointing=True), dict(BASE, ep=2, layers=4, bf16=True),
        dict(BASE, ep=2, apart=True), dict(BASE, ep=1, recompute="experts"),
        dict(BASE, ep=2, checkpointing=True, recompute="experts"),    # against one process with recompute "none"
        dict(BASE, ep=2, E=8, tokens=(1, 2))],      # 4 choices per rank: each rank routes none to 4+ experts
    4: [dict(BASE, ep=2, H=6, activation="relu"),   # 2 ranks hold each expert: sharded over them, divided by 4
        dict(BASE, ep=4, E=2)],                     # hidden-sliced experts: each expert in 2 slices
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_moe_trains_as_one_process(world, fresh_seed):
    """ep_size 1, 2 and 4 (sliced), activation checkpointing, recompute "experts", bf16 parameters with fp32
    reduction, and the layer-apart sharding of a torch without per-parameter meshes; each block is one FSDP unit
    (the experts in it on their own mesh) as a plain fully_shard per block gives; on 2 processes also: plain fully_shard
    of an expert-parallel model fails at its first forward, fully_shard_moe refuses what it cannot shard, and
    torch's state-dict API gives every expert in a full state dict (on 4: of hidden-sliced experts, whose
    sharded state dict it refuses) and moe_plugin.checkpoint saves and loads them."""
    results = run_workers(_train_cases, world, fresh_seed, CASES[world], timeout=300)
    if world == 4:
        assert results[0][-1][0] == 0.0, results[0][-1]   # every sliced expert back whole, bit for bit
        for rank_results in results:   # a sharded state dict of sliced experts: refused, naming them
            assert "hidden-sliced" in rank_results[-1][1] and "moe_plugin.checkpoint" in rank_results[-1][1]
        results = [rank_results[:-1] for rank_results in results]
    for rank_results in results:
        for spec, (error, moved, units) in zip(CASES[world], rank_results):
            assert moved > 1e-3, "the optimizer steps must change the losses, or the test could not fail"
            assert error < (3e-2 if spec.get("bf16") else 1e-10), spec
            blocks = ["", *(f"blocks.{i}" for i in range(spec["layers"]))]
            if spec.get("apart") or (spec["ep"] > 1 and fsdp.ShardPlacementResult is None):   # torch < 2.13
                assert set(blocks) < set(units) and any(name.endswith(".ffn") for name in units), units
            else:
                assert units == blocks, units
        if world == 2:
            message = rank_results[-2]
            assert message is not None and "fully_shard_moe" in message and "ep_size=2" in message, message
            sharded, two_d, host_group, ep1_state, full, own = rank_results[-1]
            assert "already sharded" in sharded and "1-D" in two_d and "ep_group" in host_group, rank_results[-1]
            assert ep1_state is None and full is None and own is None, rank_results[-1]


def _torch_api_round_trip(rank, world, seed, ep, E, ep_reload):
    """Train a model sharded by fully_shard_moe at ep_size ep 2 AdamW steps; save it with torch's state-dict API
    and DCP (what Accelerate's FSDP2 and HF Trainer's checkpoints do), sharded; load that into a fresh model of
    another seed at ep_size ep and at ep_reload, sharded, and a full state dict into another at ep; return
    {case: worst difference from the trained model} for: parameters and AdamW states (full state dicts, every
    expert), this rank's own shards, and the next step's loss."""
    import copy
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    full = StateDictOptions(full_state_dict=True)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    batches = [(torch.randint(V, (B, S), generator=generator), torch.randint(V, (B, S), generator=generator))
               for _ in range(3)]

    def trained(model_seed, ep_size, steps):
        model = fully_shard_moe(build(model_seed, ep_size, E, 6, "swiglu", True, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        for x, y in batches[:steps]:
            optimizer.zero_grad()
            step_loss(model, x, y).backward()
            optimizer.step()
        return model, optimizer

    def next_loss(model, optimizer):
        optimizer.zero_grad()
        loss = step_loss(model, *batches[2])
        loss.backward()
        optimizer.step()
        return step_loss(model, *batches[2]).item()

    def worst(a, b):
        flat_a, flat_b = dcp_flat(a), dcp_flat(b)
        assert flat_a.keys() == flat_b.keys(), sorted(set(flat_a) ^ set(flat_b))
        return max((flat_a[k].double() - flat_b[k].double()).abs().max().item() for k in flat_a)

    model, optimizer = trained(seed, ep, 2)
    want_model, want_optim = get_state_dict(model, optimizer, options=full)
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer))), checkpoint_id=path[0])
    out = {}
    for case, ep_size in (("sharded, same ep", ep), ("sharded, other ep", ep_reload)):
        fresh, fresh_optimizer = trained(seed + 7, ep_size, 1)
        state = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_optimizer)))
        dcp.load(state, checkpoint_id=path[0])
        set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got_model, got_optim = get_state_dict(fresh, fresh_optimizer, options=full)
        out[case] = max(worst(want_model, got_model), worst(want_optim, got_optim))
        if ep_size == ep:
            out[case + ", own shards"] = max(local_difference(p, q)
                                             for p, q in zip(model.parameters(), fresh.parameters()))
            out[case + ", optimizer shards"] = max(
                local_difference(a, b) for p, q in zip(model.parameters(), fresh.parameters())
                for a, b in zip(optimizer.state[p].values(), fresh_optimizer.state[q].values()) if a.dim() > 0)
    fresh, fresh_optimizer = trained(seed + 8, ep, 1)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=copy.deepcopy(want_model),   # torch's load takes
                   optim_state_dict=copy.deepcopy(want_optim), options=full)               # the dicts apart
    got_model, got_optim = get_state_dict(fresh, fresh_optimizer, options=full)
    out["full"] = max(worst(want_model, got_model), worst(want_optim, got_optim))
    out["next loss"] = abs(next_loss(model, optimizer) - next_loss(fresh, fresh_optimizer))
    out["moved"] = worst(want_model, get_state_dict(*trained(seed + 7, ep, 1), options=full)[0])
    return out


def local_difference(a, b) -> float:
    """The largest difference of two DTensors' local shards (an empty shard of an uneven split: 0)."""
    a, b = a.to_local(), b.to_local()
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def dcp_flat(state, prefix=""):
    """{path: tensor} of the tensors in a nested state dict (dicts and lists)."""
    out = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        if isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
        else:
            out.update(dcp_flat(value, f"{prefix}{key}."))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, ep, E, ep_reload", [(2, 2, 4, 1), (4, 2, 6, 1)])
def test_torch_state_dict_api_round_trips_expert_parallel_layers(world, ep, E, ep_reload, fresh_seed):
    """torch.distributed.checkpoint.state_dict + DCP (Accelerate's FSDP2 save and load, HF Trainer's checkpoints)
    at ep_size 2: a sharded save loads back exactly (every parameter and AdamW state, this rank's own shards, and
    the next step's loss), also into another ep_size and, via a full state dict, into a fresh model; on 4
    processes each expert stack is split unevenly over its 2 holders (3 experts each)."""
    results = run_workers(_torch_api_round_trip, world, fresh_seed, ep, E, ep_reload, timeout=300)
    for out in results:
        assert out.pop("moved") > 1e-3, "the fresh model must differ, or the test could not fail"
        assert max(out.values()) < 1e-12, out
