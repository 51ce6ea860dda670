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


def inputs(rank, step=0):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(50 + rank + 1000 * step))


def one_step(moe, x):
    """One forward and the backward of sum(y^2) + l_aux: (y, l_aux, x's gradient)."""
    x = x.detach().requires_grad_()
    y = moe(x)
    (y.square().sum() + y.l_aux).backward()
    return y.detach(), float(y.l_aux.detach()), x.grad


def assert_same_step(got, want, where=None):
    (y, l_aux, x_grad), (want_y, want_l_aux, want_x_grad) = got, want
    assert torch.allclose(y, want_y, rtol=1e-5, atol=1e-6) and abs(l_aux - want_l_aux) < 1e-6, where
    assert torch.allclose(x_grad, want_x_grad, rtol=1e-5, atol=1e-6), where


def expert_parallel_worker(rank, world, parallel_type, is_postscore, use_2dh=False):
    if use_2dh:      # two nodes of one process each: Tutel's 2DH exchange takes its two steps
        os.environ["LOCAL_WORLD_SIZE"] = "1"
    moe = layer(LOCAL, rank, parallel_type, is_postscore=is_postscore, use_2dh=use_2dh)
    assert moe.config.a2a == ("2dh" if use_2dh else "flat")
    step = one_step(moe, inputs(rank))
    grads = {name: param.grad.clone() for name, param in moe.get_parameter_iterator("local_experts")}
    return moe.state_dict(), step, grads


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
    for rank, (_, step, _) in enumerate(results):
        assert_same_step(step, one_step(whole, inputs(rank)), rank)
    for name, param in whole.get_parameter_iterator("local_experts"):
        expert_grads = torch.cat([r[2][name] for r in results])   # each rank's experts got both ranks' tokens
        assert torch.allclose(expert_grads, param.grad, rtol=1e-5, atol=1e-6), name


def tuned_worker(rank, world, steps):
    moe = layer(LOCAL, rank, "auto")
    outputs = [one_step(moe, inputs(rank, step)) for step in range(steps)]
    return moe.state_dict(), outputs, type(moe.tuner).__name__, sorted({s[0] for s in moe.tuner.issued_ever})


def test_parallel_type_auto_lets_the_tuner_choose_and_changes_nothing():
    """Tutel's parallel_type "auto": our tuner times experts gathered (adaptive:0) against expert parallel
    (adaptive:1) per load on 2 gloo ranks; every step, whichever it ran, equals one process."""
    steps = 12
    results = run_workers(tuned_worker, 2, steps)
    whole = layer(2 * LOCAL, 0)
    whole.load_state_dict(merged([r[0] for r in results]), strict=True)
    for rank, (_, outputs, tuner, tried) in enumerate(results):
        assert tuner == "Tuner" and tried == [0, 1]
        for step, got in enumerate(outputs):
            assert_same_step(got, one_step(whole, inputs(rank, step)), (rank, step))


def inequivalent_worker(rank, world):
    moe = layer(LOCAL, rank)
    x = inputs(rank)[: 10 + 7 * rank]       # the ranks hold different token counts
    try:
        moe(x, inequivalent_tokens=True)
    except ValueError as error:
        return str(error)
    return None


def test_inequivalent_tokens_over_processes_is_refused_by_name():
    """Tutel then takes the capacity from the largest token count over the processes; the drop-in does not, and
    says so rather than computing another capacity. On one process it is moot and runs."""
    for message in run_workers(inequivalent_worker, 2):
        assert message is not None and "inequivalent_tokens=True" in message and "more than one process" in message
    one = layer(2 * LOCAL, 0)
    x = inputs(0)
    assert torch.equal(one(x, inequivalent_tokens=True), one(x))


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
