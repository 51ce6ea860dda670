"""A layer's state dict across ranks and layouts (gloo, spawned ranks), against one process holding every expert.

An expert-parallel layer's state dict holds its rank's [E_local, ...] stacks and records, in its metadata, which
experts they are (MoELayer.expert_record). Tested, each load's outputs on fresh random tokens against one process's
layer built with the whole weights (fp64, dropless):
- the commonest habit, rank 0 saves torch.save(layer.state_dict()) and every rank loads that file, at ep_size 2
  and 4: the ranks holding those experts load them (at world 4 ep 2 rank 2 too, a replica of rank 0's), every
  other rank is refused in one line naming both sets of experts and the fix, and so is a layer at ep_size 1;
- every rank's own file loads back exactly; rank 0's ep-2 file (experts 0-1) loads at ep 4 into the ranks that
  need experts 0 and 1; a one-process state dict (ep_size 1), with or without its record, loads into ep 2, ep 4
  and hidden-sliced ep 4 (2 experts) as each rank's share; a hidden slice's file is refused by the other slice;
- expert modules (the general path): rank 0's file refused by rank 1, a one-process state dict taken as shares;
- moe_plugin.train.full_state_dict / load_full_state_dict across ep sizes (2 -> 4), and on a fully_shard_moe model
  at ep_size 1 and 2 (issue 59 item 2: it raised torch's "mixed torch.Tensor and DTensor"): every tensor of
  full_state_dict afterwards equals the loaded one, and the outputs equal the one-process model's.
"""
import os

import pytest
import torch
from torch import nn

from moe_plugin import MoEConfig, MoELayer

from helpers.launch import run_workers

D, H = 8, 16


def _config(E, ep, **extra):
    return MoEConfig(model_dim=D, hidden_size=H, num_experts=E, top_k=2, capacity_factor=0, ep_size=ep, **extra)


def _layer(seed, E, ep, expert=None, **extra):
    torch.manual_seed(seed)
    return MoELayer(_config(E, ep, **extra), expert=expert).double()


def _error(layer, reference, seed, rank) -> float:
    """Largest difference of the layer's outputs from the reference's on this rank's fresh random tokens (every
    rank of the layer's ep group must call it)."""
    x = torch.randn(7 + rank, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 31 * rank))
    with torch.no_grad():
        return (layer(x) - reference(x)).abs().max().item()


def _refusal(load) -> str:
    try:
        load()
    except ValueError as error:
        return str(error)
    return ""


def _save_on_rank0_load_everywhere(rank, world, seed, folder):
    import torch.distributed as dist
    from moe_plugin.train import full_state_dict, load_full_state_dict
    out = {}
    E = 4
    reference = _layer(seed, E, 1)        # one process, every expert: the weights every load should give
    whole = reference.state_dict()
    trained = _layer(seed, E, world)      # the same weights, each rank its share
    torch.save(trained.state_dict(), os.path.join(folder, f"ep{world}-rank{rank}.pt"))
    if world == 4:
        torch.save(_layer(seed, E, 2).state_dict(), os.path.join(folder, f"ep2-rank{rank}.pt"))
    dist.barrier()
    rank0 = torch.load(os.path.join(folder, f"ep{world}-rank0.pt"), weights_only=True)

    layer = _layer(seed + 1, E, world)                       # rank 0's file on every rank
    out["rank0_file"] = _refusal(lambda: layer.load_state_dict(rank0))
    out["rank0_file_weights"] = (layer.experts.w1_EDH - trained.experts.w1_EDH).abs().max().item()
    out["ep1_refuses"] = _refusal(lambda: _layer(seed + 1, E, 1).load_state_dict(rank0))

    layer = _layer(seed + 1, E, world)                       # each rank its own file
    layer.load_state_dict(torch.load(os.path.join(folder, f"ep{world}-rank{rank}.pt"), weights_only=True))
    out["own_file"] = _error(layer, reference, seed, rank)

    layer = _layer(seed + 1, E, world)                       # one process's state dict, with its record
    layer.load_state_dict(whole)
    out["whole"] = _error(layer, reference, seed, rank)
    layer = _layer(seed + 1, E, world)                       # and rebuilt as a plain dict (no record)
    layer.load_state_dict({k: v.clone() for k, v in whole.items()})
    out["whole_plain"] = _error(layer, reference, seed, rank)

    layer = _layer(seed + 1, E, world)                       # full_state_dict at ep 2 -> load_full_state_dict
    full = full_state_dict(_layer(seed, E, 2 if world == 4 else world))
    load_full_state_dict(layer, full)
    out["full"] = _error(layer, reference, seed, rank)

    if world == 4:
        ep2_rank0 = torch.load(os.path.join(folder, "ep2-rank0.pt"), weights_only=True)
        layer = _layer(seed + 1, E, 2)                       # rank 0's ep-2 file at ep 2: ranks 0 and 2 hold 0-1
        out["ep2_rank0_file_at_ep2"] = _refusal(lambda: layer.load_state_dict(ep2_rank0))
        out["ep2_rank0_file_at_ep2_weights"] = \
            (layer.experts.w1_EDH - whole["experts.w1_EDH"][:2] if rank % 2 == 0 else torch.zeros(1)).abs().max().item()
        layer = _layer(seed + 1, E, 4)                       # at ep 4: ranks 0 and 1 need experts 0 and 1
        out["ep2_rank0_file_at_ep4"] = _refusal(lambda: layer.load_state_dict(ep2_rank0))
        out["ep2_rank0_file_at_ep4_weights"] = (layer.experts.w1_EDH - whole["experts.w1_EDH"][rank:rank + 1]).abs(
            ).max().item() if rank < 2 else 0.0

        sliced_reference = _layer(seed, 2, 1)                # ep 4 over 2 experts: each rank half an expert
        sliced = _layer(seed + 1, 2, 4)
        sliced.load_state_dict(sliced_reference.state_dict())
        out["sliced_whole"] = _error(sliced, sliced_reference, seed, rank)
        torch.save(sliced.state_dict(), os.path.join(folder, f"sliced-rank{rank}.pt"))
        dist.barrier()
        rank0_slice = torch.load(os.path.join(folder, "sliced-rank0.pt"), weights_only=True)
        out["sliced_rank0_file"] = _refusal(lambda: _layer(seed + 1, 2, 4).load_state_dict(rank0_slice))
    else:
        expert = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
        modules_reference = _layer(seed, E, 1, expert=expert)
        modules = _layer(seed + 1, E, world, expert=expert)
        modules.load_state_dict(modules_reference.state_dict())
        out["modules_whole"] = _error(modules, modules_reference, seed, rank)
        torch.save(modules.state_dict(), os.path.join(folder, f"modules-rank{rank}.pt"))
        dist.barrier()
        rank0_modules = torch.load(os.path.join(folder, "modules-rank0.pt"), weights_only=True)
        out["modules_rank0_file"] = _refusal(lambda: _layer(seed + 1, E, world, expert=expert).load_state_dict(
            rank0_modules))
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:moe_plugin. expert module")
@pytest.mark.parametrize("world", [2, 4])
def test_save_on_rank0_load_everywhere_maps_or_refuses(world, fresh_seed, tmp_path):
    results = run_workers(_save_on_rank0_load_everywhere, world, fresh_seed, str(tmp_path), timeout=300)
    per_rank = 4 // world
    for rank, out in enumerate(results):
        mine = f"experts {rank * per_rank}..{rank * per_rank + per_rank - 1} of 4"
        if rank == 0:
            assert out["rank0_file"] == "" and out["rank0_file_weights"] == 0.0
        else:
            assert f"holds experts 0..{per_rank - 1} of 4 (saved by ep_rank 0 of ep_size {world})" in out["rank0_file"]
            assert f"this process (ep_rank {rank} of ep_size {world}) needs {mine}" in out["rank0_file"]
            assert "load_full_state_dict" in out["rank0_file"] and "\n" not in out["rank0_file"]
        assert "needs experts 0..3 of 4" in out["ep1_refuses"], out["ep1_refuses"]
        for case in ("own_file", "whole", "whole_plain", "full"):
            assert out[case] < 1e-12, (rank, case, out[case])
        if world == 4:
            assert out["ep2_rank0_file_at_ep2"] == ("" if rank % 2 == 0 else out["ep2_rank0_file_at_ep2"])
            assert rank % 2 == 0 or "needs experts 2..3 of 4" in out["ep2_rank0_file_at_ep2"]
            assert out["ep2_rank0_file_at_ep2_weights"] == 0.0
            if rank < 2:
                assert out["ep2_rank0_file_at_ep4"] == "" and out["ep2_rank0_file_at_ep4_weights"] == 0.0
            else:
                assert f"needs experts {rank}..{rank} of 4" in out["ep2_rank0_file_at_ep4"]
            assert out["sliced_whole"] < 1e-12
            slice_part = f"experts {rank // 2}..{rank // 2} (hidden slice {rank % 2} of 2)"
            assert (out["sliced_rank0_file"] == "") == (rank == 0), out["sliced_rank0_file"]
            assert rank == 0 or f"needs {slice_part}" in out["sliced_rank0_file"]
        else:
            assert out["modules_whole"] < 1e-12
            assert (out["modules_rank0_file"] == "") == (rank == 0)
            assert rank == 0 or f"needs {mine}" in out["modules_rank0_file"]


def _fsdp_load_full(rank, world, seed):
    from moe_plugin.parallel import fully_shard_moe
    from moe_plugin.train import full_state_dict, load_full_state_dict
    from moe_plugin.train.models import TransformerLM
    from moe_plugin.train.models.transformer import ModelConfig

    def build(model_seed, ep):
        torch.manual_seed(model_seed)
        moe = MoEConfig(model_dim=8, hidden_size=H, num_experts=4, top_k=2, capacity_factor=0, ep_size=ep)
        return TransformerLM(ModelConfig(dim=8, layers=2, heads=2, seq_len=6, ffn_hidden=12, moe_every=1), moe,
                             50).double()

    reference = build(seed, 1)
    state = reference.state_dict()
    tokens = torch.randint(50, (3, 6), generator=torch.Generator().manual_seed(seed + rank))
    out = {}
    for ep in (1, 2):
        model = build(seed + 1, ep)
        fully_shard_moe(model)
        load_full_state_dict(model, state)
        again = full_state_dict(model)
        out[f"ep{ep}_state"] = max((again[k].double() - v.double()).abs().max().item() for k, v in state.items()
                                   if v.is_floating_point())
        out[f"ep{ep}_keys"] = sorted(again) == sorted(state)
        with torch.no_grad():
            out[f"ep{ep}_outputs"] = (model(tokens) - reference(tokens)).abs().max().item()
    return out


@pytest.mark.slow
def test_load_full_state_dict_on_fully_shard_moe(fresh_seed):
    for out in run_workers(_fsdp_load_full, 2, fresh_seed, timeout=300):
        for ep in (1, 2):
            assert out[f"ep{ep}_keys"] and out[f"ep{ep}_state"] == 0.0, out
            assert out[f"ep{ep}_outputs"] < 1e-12, out
