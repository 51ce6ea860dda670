"""The fairseq adapter on several CPU processes (gloo, --ddp-backend legacy_ddp).

fairseq-fixed's legacy_ddp leaves parameters marked `expert` out of its all-reduce and the trainer
then scales every gradient by W / sample_size; the adapter's gradient hook must make an expert's
gradient what one process would compute on the global batch. Checked end to end: one SGD step
(lr 1, so the step is the gradient) of a 2-process expert-parallel fairseq-train run against one
process with --update-freq 2 on the same two batches.
"""
import argparse
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from helpers.fairseq import CPU, TINY_LM, needs_fairseq, run_modules, train_distributed, user_dir
from helpers.launch import run_workers
from moe_plugin import MoEConfig, MoELayer

pytestmark = needs_fairseq


def lm_args(data, save_dir, lr, max_update, extra=()):
    # dropless (capacity factor 0) and no gate loss: the step is then a sum over tokens, whatever the split
    return [data, "--user-dir", user_dir(), "--task", "language_modeling", *TINY_LM,
            "--moe-capacity-factor", "0", "--moe-gate-loss-wt", "0", "--criterion", "moe_cross_entropy",
            "--optimizer", "sgd", "--lr", lr, "--dropout", "0", "--tokens-per-sample", "64",
            "--sample-break-mode", "complete", "--batch-size", "4", "--max-update", max_update,
            "--save-dir", save_dir, "--no-epoch-checkpoints", "--disable-validation", *CPU, *extra]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    root, lm = str(tmp_path_factory.mktemp("fairseq_ddp")), corpus["lm"]
    dirs = {name: os.path.join(root, name) for name in ("ep", "single", "init")}
    logs = train_distributed(lm_args(lm, dirs["ep"], 1.0, 1, ["--moe-ep-size", "2"]), 2, cwd=root)
    # the one-process step and the initial weights (a step at lr 0), two fairseq-train runs in one interpreter
    run_modules([("fairseq_cli.train", lm_args(lm, dirs["single"], 1.0, 1, ["--update-freq", "2"])),
                 ("fairseq_cli.train", lm_args(lm, dirs["init"], 0.0, 1))], cwd=root)
    return {"root": root, "lm": lm, "logs": logs, **dirs}


def test_two_process_expert_parallel_step_equals_the_single_process_step(runs):
    assert "num. expert model params: 0 " not in runs["logs"][0] and "num. expert model params:" in runs["logs"][0]
    ranks = [load(os.path.join(runs["ep"], f"checkpoint_last-rank-{r}.pt"))["model"] for r in range(2)]
    single = load(os.path.join(runs["single"], "checkpoint_last.pt"))["model"]
    init = load(os.path.join(runs["init"], "checkpoint_last.pt"))["model"]
    assert set(ranks[0]) == set(single)
    largest_step = max(float((single[k] - init[k]).abs().max()) for k in single)
    assert largest_step > 1e-3
    experts = [k for k in single if ".experts." in k]
    assert len(experts) == 2 * 4   # 2 MoE layers x (w1, b1, w2, b2)
    for key in single:
        if key in experts:
            assert not torch.equal(ranks[0][key], ranks[1][key]), key   # each rank holds its own experts
            for rank, state in enumerate(ranks):
                mine = slice(2 * rank, 2 * rank + 2)                   # 4 experts over 2 ranks
                step, want = init[key][mine] - state[key], init[key][mine] - single[key][mine]
                assert float(want.abs().max()) > 0, key
                torch.testing.assert_close(step, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()), msg=key)
        else:
            assert torch.equal(ranks[0][key], ranks[1][key]), key     # shared weights stay identical
            torch.testing.assert_close(init[key] - ranks[0][key], init[key] - single[key], rtol=1e-4,
                                       atol=1e-5 * largest_step, msg=key)


def test_two_process_run_resumes_per_rank_and_consolidates_for_eval_lm(runs, tmp_path):
    save_dir = str(tmp_path / "ep")
    shutil.copytree(runs["ep"], save_dir)
    logs = train_distributed(lm_args(runs["lm"], save_dir, 1.0, 2, ["--moe-ep-size", "2"]), 2, cwd=runs["root"])
    assert "checkpoint_last-rank-0.pt (epoch 1 @ 1 updates)" in logs[0]
    states = [load(os.path.join(save_dir, f"checkpoint_last-rank-{r}.pt")) for r in range(2)]
    before = [load(os.path.join(runs["ep"], f"checkpoint_last-rank-{r}.pt"))["model"] for r in range(2)]
    for rank, state in enumerate(states):
        assert state["optimizer_history"][-1]["num_updates"] == 2
        key = "decoder.layers.0.fc1.moe.experts.w1_EDH"
        assert not torch.equal(state["model"][key], before[rank][key])   # went on from its own experts
    shared = "decoder.layers.0.fc1.moe.router.weight_ED"
    assert torch.equal(states[0]["model"][shared], states[1]["model"][shared])

    # `python -m ...consolidate` then `python -m fairseq_cli.eval_lm` on its output, in one interpreter
    merged = str(tmp_path / "merged.pt")
    out, log = (done.stdout for done in run_modules([
        ("moe_plugin.integrations.fairseq_moe.consolidate", [os.path.join(save_dir, "checkpoint_last-rank-0.pt"), merged,
                                                             "--weights-only"]),   # (an SGD run: the tool carries Adam only)
        ("fairseq_cli.eval_lm", [runs["lm"], "--user-dir", user_dir(), "--path", merged, "--tokens-per-sample", "64",
                                 "--batch-size", "8", "--cpu", "--num-workers", "0"])], cwd=runs["root"]))
    assert "merged the experts of 2 ranks" in out, out[-3000:]
    assert float(log.split("Perplexity:")[1].split()[0]) > 1.0


def _legacy_ddp_step(rank, world_size, seed, tokens):
    """One legacy_ddp step of a bare MoE layer with ep_size 2 on 4 ranks, and the one-process reference."""
    from fairseq.distributed import utils as distributed_utils
    from fairseq.distributed.legacy_distributed_data_parallel import LegacyDistributedDataParallel
    from moe_plugin.integrations.fairseq_moe.distributed import prepare_expert_parameters

    torch.manual_seed(seed)
    config = dict(model_dim=6, hidden_size=8, num_experts=4, top_k=2, capacity_factor=0.0, min_capacity=0)
    full = MoELayer(MoEConfig(**config)).double()
    layer = MoELayer(MoEConfig(**config, ep_size=2)).double()
    layer.load_full_state_dict(full.state_dict())
    for bad, message in ((dict(ddp_backend="pytorch_ddp"), "needs --ddp-backend legacy_ddp"),
                         (dict(ddp_backend="legacy_ddp", fp16=True), "needs --fp16-no-flatten-grads")):
        with pytest.raises(ValueError, match=message):
            prepare_expert_parameters(layer, argparse.Namespace(moe_ep_size=2, **bad))
    assert prepare_expert_parameters(layer, argparse.Namespace(ddp_backend="legacy_ddp", moe_ep_size=2)) == 4
    ddp = LegacyDistributedDataParallel(layer, process_group=distributed_utils.get_data_parallel_group())

    generator = torch.Generator().manual_seed(seed + 1)
    x_WTD = torch.randn(world_size, tokens, 6, generator=generator, dtype=torch.float64)
    upstream_WTD = torch.randn(world_size, tokens, 6, generator=generator, dtype=torch.float64)
    total = world_size * tokens                                   # the trainer's sample_size, summed over ranks
    (ddp(x_WTD[rank]) * upstream_WTD[rank]).sum().backward()     # a summed loss, as fairseq's criterions give
    ddp.all_reduce_grads()
    for param in layer.parameters():
        param.grad.mul_(world_size / total)                       # the trainer's multiply_grads(W / sample_size)
    (full(x_WTD.reshape(total, 6)) * upstream_WTD.reshape(total, 6)).sum().div(total).backward()

    layout, errors = layer.groups.layout, {}
    mine = slice(layout.first_expert, layout.first_expert + layout.local_experts)
    for name, param in layer.named_parameters():
        want = dict(full.named_parameters())[name].grad
        want = want[mine] if name.startswith("experts.") else want
        errors[name] = float((param.grad - want).abs().max() / want.abs().max())
    replicas = dist.get_world_size(layer.groups.expert_data_group)
    return errors, replicas


def test_expert_grads_are_reduced_over_expert_data_group_when_ep_size_is_below_world(fresh_seed):
    results = run_workers(_legacy_ddp_step, 4, fresh_seed, 5, timeout=180)
    for rank, (errors, replicas) in enumerate(results):
        assert replicas == 2
        assert max(errors.values()) < 1e-12, (rank, errors)


def test_reshard_per_rank_checkpoints_to_another_ep_size_and_resume(runs, tmp_path):
    """2 ranks with --moe-ep-size 2 -> 4 per-rank checkpoints with ep 4 (one expert each) -> back to ep 2, with
    --weights-only (an SGD run's state is not carried: test_fairseq_reshard_optimizer.py carries Adam's); fairseq-train
    then resumes the resharded weights on 2 processes (a fresh optimizer: its update count restarts at 0, as with
    --reset-optimizer)."""
    from moe_plugin.integrations.fairseq_moe.consolidate import EXPERT_TENSORS, main as consolidate

    before = [load(os.path.join(runs["ep"], f"checkpoint_last-rank-{r}.pt")) for r in range(2)]
    assert consolidate([os.path.join(runs["ep"], "checkpoint_last-rank-0.pt"), str(tmp_path / "ep4"),
                        "--ep-size", "4", "--weights-only"]) == 0
    four = [load(tmp_path / "ep4" / f"checkpoint_last-rank-{r}.pt") for r in range(4)]
    experts = [key for key in before[0]["model"] if key.endswith(EXPERT_TENSORS)]
    assert len(experts) == 8
    for key, value in before[0]["model"].items():
        whole = torch.cat([state["model"][key] for state in before]) if key in experts else value
        for rank, state in enumerate(four):
            assert torch.equal(state["model"][key], whole[rank:rank + 1] if key in experts else whole), (key, rank)
    for rank, state in enumerate(four):
        assert state["cfg"]["model"].moe_ep_size == 4 and state["cfg"]["model"].base_layers == 1
        assert state["cfg"]["checkpoint"]["checkpoint_suffix"] == f"-rank-{rank}"
        assert "last_optimizer_state" not in state
    assert consolidate([str(tmp_path / "ep4" / "checkpoint_last-rank-0.pt"), str(tmp_path / "ep3"),
                        "--ep-size", "3", "--weights-only"]) == 2

    save_dir = tmp_path / "ep2"
    assert consolidate([str(tmp_path / "ep4" / "checkpoint_last-rank-0.pt"), str(save_dir), "--ep-size", "2",
                        "--weights-only"]) == 0
    for rank in range(2):
        again = load(save_dir / f"checkpoint_last-rank-{rank}.pt")["model"]
        assert all(torch.equal(again[key], value) for key, value in before[rank]["model"].items())
    logs = train_distributed(lm_args(runs["lm"], str(save_dir), 1.0, 2, ["--moe-ep-size", "2"]), 2, cwd=runs["root"])
    assert "checkpoint_last-rank-0.pt (epoch 1 @ 0 updates)" in logs[0]
    after = [load(save_dir / f"checkpoint_last-rank-{rank}.pt") for rank in range(2)]
    assert after[1]["optimizer_history"][-1]["num_updates"] == 2
    key = "decoder.layers.0.fc1.moe.experts.w1_EDH"
    for rank in range(2):   # each rank trained on from its own resharded experts
        assert not torch.equal(after[rank]["model"][key], before[rank]["model"][key])
        assert float((after[rank]["model"][key] - before[rank]["model"][key]).abs().max()) < 1.0
