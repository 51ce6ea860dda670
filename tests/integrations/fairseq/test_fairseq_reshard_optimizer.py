"""The consolidate tool carries fairseq's Adam state across layouts (issue 54 item 3).

One 2-process run at --moe-ep-size 2 (fairseq's Adam, eps 1e-6, fp32, --cpu, an inverse_sqrt warmup, global batch
2 ranks x --update-freq 2) saves after update 2 (checkpoint_1_2-rank-R.pt) and goes on uninterrupted to update 3
(checkpoint_last-rank-R.pt): the reference. Its update-2 files are merged (1 process) and resharded (ep 1 on 2
processes, ep 4 on 4, ep 2 on 4). In process: every parameter's moments, gathered whole, are bit-equal before and
after; the optimizer's index of each parameter is that of the model fairseq builds. Then fairseq-train
--restore-file resumes the merged file on 1 process (--update-freq 4) and the ep-1 file on 2 (--update-freq 2), and
update 3 equals the reference's (rel 1e-4)."""
import io
import os

import pytest
import torch

from helpers.fairseq import CPU, TINY_LM, needs_fairseq, run_modules, train_distributed, user_dir

pytestmark = needs_fairseq


def adam_args(data, save_dir, extra=()):
    # dropless (capacity factor 0) and no gate loss: the update is then a sum over tokens, whatever the split
    return [data, "--user-dir", user_dir(), "--task", "language_modeling", *TINY_LM,
            "--moe-capacity-factor", "0", "--moe-gate-loss-wt", "0", "--criterion", "moe_cross_entropy",
            "--optimizer", "adam", "--adam-eps", "1e-6", "--lr", "0.01", "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", "4", "--dropout", "0", "--tokens-per-sample", "64", "--sample-break-mode", "complete",
            "--batch-size", "4", "--max-update", "3", "--save-interval-updates", "2", "--save-dir", save_dir,
            "--no-epoch-checkpoints", "--disable-validation", *CPU, *extra]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def consolidate(*argv):
    from moe_plugin.integrations.fairseq_moe.consolidate import main
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("fairseq_adam")
    ref = str(root / "ref")
    train_distributed(adam_args(corpus["lm"], ref, ["--moe-ep-size", "2", "--update-freq", "2"]), 2, cwd=str(root))
    rank0 = os.path.join(ref, "checkpoint_1_2-rank-0.pt")
    assert consolidate(rank0, root / "w1.pt") == 0
    assert consolidate(rank0, root / "w2e1", "--world-size", "2") == 0
    assert consolidate(rank0, root / "w4e4", "--ep-size", "4") == 0
    assert consolidate(rank0, root / "w4e2", "--ep-size", "2", "--world-size", "4") == 0
    return {"root": root, "ref": ref, "lm": corpus["lm"], "rank0": rank0}


def gathered(states):
    """{index: {field: value}} of the whole model from one expert-parallel group's states (experts concatenated)."""
    from moe_plugin.integrations.fairseq_moe.consolidate import EXPERT_TENSORS, parameter_keys
    keys = parameter_keys(states[0], "rank 0")
    whole = {}
    for index, key in enumerate(keys):
        moments = [state["last_optimizer_state"]["state"][index] for state in states]
        whole[index] = {field: torch.cat([m[field] for m in moments]) if key.endswith(EXPERT_TENSORS) and
                        torch.is_tensor(value) else value for field, value in moments[0].items()}
    return keys, whole


def test_moments_gathered_whole_are_bit_equal_after_merge_and_reshard(run):
    root = run["root"]
    source = [load(os.path.join(run["ref"], f"checkpoint_1_2-rank-{r}.pt")) for r in range(2)]
    keys, want = gathered(source)
    assert sum(".experts." in key for key in keys) == 8 and len(want) == len(keys) == 38
    layouts = {"w1": ([root / "w1.pt"], 1), "w2e1": ([root / "w2e1" / "checkpoint_1_2.pt"], 2),
               "w4e4": ([root / "w4e4" / f"checkpoint_1_2-rank-{r}.pt" for r in range(4)], 4),
               "w4e2": ([root / "w4e2" / f"checkpoint_1_2-rank-{r}.pt" for r in range(4)], 4)}
    for name, (paths, world) in layouts.items():
        states = [load(path) for path in paths]
        ep = states[0]["cfg"]["model"].moe_ep_size
        got_keys, got = gathered(states[:ep])
        assert got_keys == keys, name
        for index, moments in want.items():
            assert set(got[index]) == {"step", "exp_avg", "exp_avg_sq"}, name
            for field, value in moments.items():
                same = torch.equal(got[index][field], value) if torch.is_tensor(value) else got[index][field] == value
                assert same, (name, keys[index], field)
        for rank, state in enumerate(states):
            assert state["optimizer_history"] == source[0]["optimizer_history"], name
            assert state["optimizer_history"][-1]["num_updates"] == 2
            assert state["last_optimizer_state"]["param_groups"] == source[0]["last_optimizer_state"]["param_groups"]
            # 4 batches per rank on 2 ranks = 8 global batches of the epoch done
            assert state["extra_state"]["train_iterator"]["iterations_in_epoch"] == 8 // world, name
            assert state["cfg"]["distributed_training"]["distributed_world_size"] == world
            if ep < world:     # a copy of an expert-parallel group: the same moments
                twin = states[rank % ep]["last_optimizer_state"]["state"]
                assert all(torch.equal(twin[i]["exp_avg"], m["exp_avg"])
                           for i, m in state["last_optimizer_state"]["state"].items())
    # and back: ep 4 -> merged equals the direct merge, bit for bit
    assert consolidate(root / "w4e4" / "checkpoint_1_2-rank-0.pt", root / "again.pt") == 0
    again, direct = load(root / "again.pt"), load(root / "w1.pt")
    assert all(torch.equal(again["model"][k], v) for k, v in direct["model"].items())
    assert gathered([again])[1].keys() == want.keys()
    assert all(torch.equal(gathered([again])[1][i]["exp_avg_sq"], m["exp_avg_sq"]) for i, m in want.items())


@pytest.mark.parametrize("tied", [False, True])
def test_optimizer_indices_are_the_positions_of_the_model_fairseq_builds(run, tied):
    """The tool's parameter_keys, read from a saved file, against the requires_grad parameters of the model fairseq's
    task builds (the order its trainer hands the optimizer), with tied input and output embeddings too."""
    from fairseq import tasks
    from omegaconf import OmegaConf

    from moe_plugin.integrations.fairseq_moe.consolidate import parameter_keys

    merged = load(run["root"] / "w1.pt")
    cfg = OmegaConf.create({k: v for k, v in merged["cfg"].items() if k != "model"})
    cfg.task.data = run["lm"]
    merged["cfg"]["model"].share_decoder_input_output_embed = tied
    model = tasks.setup_task(cfg.task).build_model(merged["cfg"]["model"])
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    optimizer = torch.optim.Adam([param for param in model.parameters() if param.requires_grad])
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "last_optimizer_state": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert len(saved["model"]) > len(names) + 2    # buffers (and with tied, the tied copy) are keys too
    assert parameter_keys(saved, "built") == names
    if not tied:
        assert parameter_keys(merged, "w1.pt") == names


def test_optimizer_state_it_cannot_carry_is_refused_in_one_line(run, tmp_path, capsys):
    source = [load(os.path.join(run["ref"], f"checkpoint_1_2-rank-{r}.pt")) for r in range(2)]
    cases = {"SGD": lambda s: s["optimizer_history"][-1].update(optimizer_name="SGD"),
             "--fp16": lambda s: s["cfg"]["common"].update(fp16=True),
             "absent": lambda s: s.pop("last_optimizer_state"),
             "differs from rank 0's": lambda s: s["last_optimizer_state"]["state"][0]["exp_avg"].add_(1e-7)}
    for words, spoil in cases.items():
        folder = tmp_path / words.strip("-'s ")
        os.makedirs(folder)
        for rank, state in enumerate(source):
            state = load(os.path.join(run["ref"], f"checkpoint_1_2-rank-{rank}.pt"))
            if rank == 1:
                spoil(state)
            torch.save(state, folder / f"checkpoint_1_2-rank-{rank}.pt")
        assert consolidate(folder / "checkpoint_1_2-rank-0.pt", tmp_path / "out.pt") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "checkpoint_1_2-rank-1.pt" in err, err
        if words != "differs from rank 0's":
            assert "fairseq's Adam (--optimizer adam) in fp32" in err and "--weights-only" in err, err
        assert not os.path.exists(tmp_path / "out.pt")
        if words in ("SGD", "--fp16"):
            assert consolidate(folder / "checkpoint_1_2-rank-0.pt", tmp_path / "out.pt", "--weights-only") == 0
            assert "last_optimizer_state" not in load(tmp_path / "out.pt")
            os.unlink(tmp_path / "out.pt")


@pytest.mark.spawns
def test_resumed_at_another_world_and_ep_size_the_next_update_equals_the_uninterrupted_run(run):
    root, lm = run["root"], run["lm"]
    one = run_modules([("fairseq_cli.train", adam_args(lm, str(root / "r_w1"), [
        "--update-freq", "4", "--restore-file", root / "w1.pt"]))], cwd=str(root))[0].stdout
    # (--load-checkpoint-on-all-dp-ranks: fairseq-fixed's broadcast of rank 0's checkpoint to the others fails to
    # unpickle under torch >= 2.6, on any fairseq run without per-rank checkpoints)
    two = train_distributed(adam_args(lm, str(root / "r_w2e1"), [
        "--update-freq", "2", "--load-checkpoint-on-all-dp-ranks",
        "--restore-file", root / "w2e1" / "checkpoint_1_2.pt"]), 2, cwd=str(root))[0]
    for log, path in ((one, root / "w1.pt"), (two, root / "w2e1" / "checkpoint_1_2.pt")):
        assert f"Loaded checkpoint {path} (epoch 1 @ 2 updates)" in log, log[-3000:]
    ref = [load(os.path.join(run["ref"], f"checkpoint_last-rank-{r}.pt")) for r in range(2)]
    before = [load(os.path.join(run["ref"], f"checkpoint_1_2-rank-{r}.pt")) for r in range(2)]
    whole = lambda states, key: torch.cat([s["model"][key] for s in states]) if ".experts." in key \
        else states[0]["model"][key]  # noqa: E731
    for name in ("r_w1", "r_w2e1"):
        after = load(root / name / "checkpoint_last.pt")
        assert after["optimizer_history"][-1]["num_updates"] == 3
        assert after["optimizer_history"][-1]["lr_scheduler_state"] == ref[0]["optimizer_history"][-1][
            "lr_scheduler_state"]
        for key in ref[0]["model"]:
            if key.endswith(".version") or key.endswith("k_proj.bias"):
                # (a key bias's gradient is zero in exact arithmetic, softmax being blind to it: rounding noise,
                # which Adam turns into steps of up to lr whatever the layout)
                continue
            want = whole(ref, key) - whole(before, key)
            step = whole([after], key) - whole(before, key)
            torch.testing.assert_close(step, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()), msg=(name, key))
            if not key.endswith("expert_bias_E"):
                assert float(want.abs().max()) > 1e-4, key    # an update a fresh Adam would not give
