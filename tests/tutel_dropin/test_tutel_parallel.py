"""The drop-in over processes: expert parallel (also with use_2dh over two one-process nodes, and experts gathered,
parallel_type adaptive:0) on 2 gloo ranks equals one process holding every expert; examples/tutel_helloworld.py under torchrun on 2 processes (top 1 and 2, capacity
factor 0 and negative, parallel_type data and model): its first loss on each rank equals one process's, and where
Tutel is installed every step's loss equals real Tutel's from the same weights."""
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.launch import run_workers, torchrun
from tutel_common import HAVE_TUTEL, NO_TUTEL

import moe_plugin
from moe_plugin import tutel as tutel_moe
from moe_plugin.tutel import names

D, H, LOCAL, T = 8, 6, 2, 30
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tutel_helloworld.py"


def layer(count, rank, parallel_type="adaptive:1", cf=0.75, kind="ffn", is_postscore=True, use_2dh=False):
    experts = {"type": kind, "count_per_node": count, "hidden_size_per_expert": H}
    if kind == "ffn":
        experts["activation_fn"] = F.relu
    return tutel_moe.moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": cf}, model_dim=D,
                               experts=experts, seeds=(1, rank + 1, 1), parallel_type=parallel_type,
                               is_postscore=is_postscore, use_2dh=use_2dh)


def inputs(rank):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(50 + rank))


def expert_parallel_worker(rank, world, parallel_type, is_postscore, use_2dh=False):
    if use_2dh:      # two nodes of one process each: Tutel's 2DH exchange takes its two steps
        os.environ["LOCAL_WORLD_SIZE"] = "1"
    moe = layer(LOCAL, rank, parallel_type, is_postscore=is_postscore, use_2dh=use_2dh)
    assert moe.config.a2a == ("2dh" if use_2dh else "flat")
    x = inputs(rank).requires_grad_()
    y = moe(x)
    (y.square().sum() + y.l_aux).backward()
    grads = {name: param.grad.clone() for name, param in moe.get_parameter_iterator("local_experts")}
    return moe.state_dict(), y.detach(), float(y.l_aux), x.grad, grads


def merged(states):
    """One process's state dict from each rank's: the experts concatenated in rank order, the gate rank 0's."""
    out = dict(states[0])      # _num_global_experts: every rank's counts them all
    for key in states[0]:
        if key.startswith("experts."):
            out[key] = torch.cat([s[key] for s in states])
    assert all(torch.equal(s["gates.0.wg.weight"], out["gates.0.wg.weight"]) for s in states)
    return out


@pytest.mark.parametrize("parallel_type, is_postscore, use_2dh", [("adaptive:1", True, False),
                                                                  ("adaptive:0", True, False),
                                                                  ("adaptive:1", False, False),
                                                                  ("adaptive:1", True, True)])
def test_two_ranks_equal_one_process(parallel_type, is_postscore, use_2dh):
    results = run_workers(expert_parallel_worker, 2, parallel_type, is_postscore, use_2dh)
    whole = layer(2 * LOCAL, 0, is_postscore=is_postscore)
    whole.load_state_dict(merged([r[0] for r in results]), strict=True)
    expert_grads = []
    for rank, (_, y, l_aux, x_grad, _) in enumerate(results):
        x = inputs(rank).requires_grad_()
        want = whole(x)
        (want.square().sum() + want.l_aux).backward()
        assert torch.allclose(y, want, rtol=1e-5, atol=1e-6) and abs(l_aux - float(want.l_aux)) < 1e-6
        assert torch.allclose(x_grad, x.grad, rtol=1e-5, atol=1e-6)
    for name, param in whole.get_parameter_iterator("local_experts"):
        expert_grads = torch.cat([r[4][name] for r in results])   # each rank's experts got both ranks' tokens
        assert torch.allclose(expert_grads, param.grad, rtol=1e-5, atol=1e-6), name


def full_state_worker(rank, world, kind, full):
    moe = layer(LOCAL, rank + 7, kind=kind)
    moe.load_full_state_dict(full)
    return moe.state_dict()


@pytest.mark.parametrize("kind", ["ffn", "llama_ffn"])
def test_a_full_state_dict_splits_over_ranks(kind):
    full = layer(2 * LOCAL, 0, kind=kind).state_dict()
    states = run_workers(full_state_worker, 2, kind, full)
    assert states[0]["experts." + ("batched_fc1_w" if kind == "ffn" else "W_fc1")].numel() * 2 == \
        full["experts." + ("batched_fc1_w" if kind == "ffn" else "W_fc1")].numel()
    together = merged(states)
    assert list(together) == list(full) and all(torch.equal(together[key], full[key]) for key in full)


def fsdp_worker(rank, world, drop_in):
    """3 SGD steps of Linear -> the layer -> Linear under fully_shard_moe (expert parallel over both ranks): the
    drop-in, or a plain MoELayer with its config and weights."""
    from moe_plugin.parallel import fully_shard_moe
    moe = layer(LOCAL, rank)
    if not drop_in:
        plain = moe_plugin.MoELayer(moe.config)
        plain.load_state_dict(names.tutel_to_moe(moe.state_dict()), strict=True)
        moe = plain
    torch.manual_seed(4)
    model = fully_shard_moe(torch.nn.Sequential(torch.nn.Linear(D, D), moe, torch.nn.Linear(D, 3)).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(60 + rank)
    x, y = torch.randn(T, D, generator=generator, dtype=torch.float64), torch.randint(3, (T,), generator=generator)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(x), y) + 0.01 * moe_plugin.aux_loss(model)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def test_fsdp2_trains_the_drop_in_as_it_trains_moe_layer():
    drop_in, plain = (run_workers(fsdp_worker, 2, flag) for flag in (True, False))
    assert torch.allclose(torch.tensor(drop_in), torch.tensor(plain), rtol=1e-12, atol=0)
    assert all(losses[0] != losses[-1] for losses in drop_in)


def _example():
    spec = importlib.util.spec_from_file_location("tutel_helloworld", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("top, capacity_factor, parallel_type", [(1, 0.0, "data"), (2, -0.5, "model")])
def test_helloworld_under_torchrun(top, capacity_factor, parallel_type, tmp_path):
    arguments = ["--top", str(top), "--capacity_factor", str(capacity_factor), "--parallel_type", parallel_type,
                 "--num_steps", "3"]
    torchrun(str(EXAMPLE), *arguments, "--out", str(tmp_path / "ours"))
    losses = [json.loads((tmp_path / "ours" / f"losses_rank{r}.json").read_text()) for r in range(2)]
    example = _example()
    args = example.parse(arguments)
    states = [torch.load(tmp_path / "ours" / f"init_rank{r}.pt") for r in range(2)]
    args.num_local_experts *= 2
    model = example.ExampleModel(tutel_moe, args, 0)
    model.moe.load_state_dict(merged(states), strict=True)
    for rank in range(2):
        x, y = example.batch(args, rank)
        first = F.nll_loss(model(x), y) + args.l_aux_wt * model.moe.l_aux
        assert abs(float(first) - losses[rank][0]) < 1e-5 * abs(losses[rank][0]), rank
    assert all(rank_losses[-1] < rank_losses[0] for rank_losses in losses)
    if not HAVE_TUTEL:
        pytest.skip(f"the comparison with real Tutel: {NO_TUTEL}")
    torchrun(str(EXAMPLE), *arguments, "--impl", "tutel", "--out", str(tmp_path / "tutel"))
    theirs = [json.loads((tmp_path / "tutel" / f"losses_rank{r}.json").read_text()) for r in range(2)]
    for ours_rank, theirs_rank in zip(losses, theirs):
        assert ours_rank == pytest.approx(theirs_rank, rel=1e-5)
