"""The consolidate tool (integrations/fairseq_moe/consolidate.py) with the user's files: it writes no file that
exists unless given --overwrite, never the source run's own per-rank checkpoints (which hold the optimizer state)
even with --overwrite, and a missing, truncated or foreign rank file or a refused destination ends in one line
naming the file, exit status 2. Each case checks the bytes of every file before and after. The checkpoints are
made here in fairseq's layout (no fairseq run): what the tool reads of them is cfg, the model's tensors, the
optimizer's name and Adam's state (test_fairseq_reshard_optimizer.py has a real run's)."""
import argparse
import os
import subprocess
import sys

import torch

from helpers.fairseq import needs_fairseq

pytestmark = needs_fairseq   # the tool imports no fairseq, but its package (the --user-dir) does

EXPERTS = 4


def consolidate(argv) -> int:
    from moe_plugin.integrations.fairseq_moe.consolidate import main
    return main(argv)


def write_run(folder, ep_size=2):
    """The per-rank checkpoints of a run with --moe-ep-size ep_size; returns rank 0's path."""
    os.makedirs(folder, exist_ok=True)
    router = torch.randn(EXPERTS, 6)
    for rank in range(ep_size):
        local = EXPERTS // ep_size
        model = {"decoder.layers.0.fc1.moe.router.weight_ED": router,
                 "decoder.layers.0.fc1.moe.experts.w1_EDH": torch.randn(local, 6, 8),
                 "decoder.layers.0.fc1.moe.experts.b1_EH": torch.randn(local, 8),
                 "decoder.layers.0.fc1.moe.experts.w2_EHD": torch.randn(local, 8, 6),
                 "decoder.layers.0.fc1.moe.experts.b2_ED": torch.randn(local, 6)}
        # fairseq's Adam state: index i is the model's i-th parameter
        adam = {"state": {i: {"step": 3, "exp_avg": torch.full_like(value, float(rank if i else 1)),
                              "exp_avg_sq": torch.ones_like(value)} for i, value in enumerate(model.values())},
                "param_groups": [{"lr": 0.1, "params": list(range(len(model)))}]}
        state = {"model": model,
                 "cfg": {"model": argparse.Namespace(moe_ep_size=ep_size, moe_expert_count=EXPERTS, base_layers=1),
                         "checkpoint": {"checkpoint_suffix": f"-rank-{rank}"}, "common": {},
                         "distributed_training": {"distributed_world_size": ep_size}},
                 "optimizer_history": [{"optimizer_name": "FairseqAdam", "num_updates": 3}],
                 "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 2}},
                 "last_optimizer_state": adam}
        torch.save(state, os.path.join(folder, f"checkpoint_last-rank-{rank}.pt"))
    return os.path.join(folder, "checkpoint_last-rank-0.pt")


def contents(folder):
    """{name: bytes} of every file under folder."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as file:
                found[os.path.relpath(path, folder)] = file.read()
    return found


def refused(argv, capsys, *words):
    """consolidate(argv) exits 2 with one line on stderr holding words."""
    assert consolidate([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("consolidate: "), err
    assert all(word in err for word in words), err
    return err


def test_reshard_into_the_source_folder_is_refused_even_with_overwrite(tmp_path, capsys):
    rank0 = write_run(tmp_path / "ep2")
    before = contents(tmp_path)
    for extra in ([], ["--overwrite"]):
        refused([rank0, tmp_path / "ep2", "--ep-size", "2", *extra], capsys, "checkpoint_last-rank-0.pt",
                "source run's checkpoints")
        refused([rank0, tmp_path / "ep2", "--ep-size", "4", *extra], capsys, "source run's checkpoints")
        refused([rank0, rank0, *extra], capsys, "source run's checkpoints")           # merged over rank 0
        refused([rank0, tmp_path / "ep2" / "checkpoint_last-rank-1.pt", *extra], capsys, "source run's")
    assert contents(tmp_path) == before


def test_an_existing_destination_is_replaced_only_with_overwrite(tmp_path, capsys):
    rank0 = write_run(tmp_path / "ep2")
    (tmp_path / "merged.pt").write_bytes(b"the user's own file")
    os.makedirs(tmp_path / "ep4")
    (tmp_path / "ep4" / "checkpoint_last-rank-3.pt").write_bytes(b"another run's rank 3")
    before = contents(tmp_path)
    refused([rank0, tmp_path / "merged.pt"], capsys, "merged.pt exists", "--overwrite")
    refused([rank0, tmp_path / "ep4", "--ep-size", "4"], capsys, "checkpoint_last-rank-3.pt exists", "--overwrite")
    assert contents(tmp_path) == before          # nothing written, not even ranks 0-2 of ep4

    assert consolidate([str(rank0), str(tmp_path / "merged.pt"), "--overwrite"]) == 0
    assert consolidate([str(rank0), str(tmp_path / "ep4"), "--ep-size", "4", "--overwrite"]) == 0
    after = contents(tmp_path)
    assert {name: after[name] for name in before if name.startswith("ep2")} == \
        {name: data for name, data in before.items() if name.startswith("ep2")}
    assert sorted(after) == sorted(list(before) + [f"ep4/checkpoint_last-rank-{r}.pt" for r in range(3)])  # no .tmp
    merged = torch.load(tmp_path / "merged.pt", weights_only=False)
    assert merged["model"]["decoder.layers.0.fc1.moe.experts.w1_EDH"].shape[0] == EXPERTS
    assert merged["cfg"]["model"].moe_ep_size == 1
    assert merged["last_optimizer_state"]["state"][1]["exp_avg"][:, 0, 0].tolist() == [0, 0, 1, 1]  # ranks' moments
    assert torch.load(tmp_path / "ep4" / "checkpoint_last-rank-3.pt", weights_only=False)["cfg"]["model"].moe_ep_size == 4
    # a fresh destination needs no flag
    assert consolidate([str(rank0), str(tmp_path / "fresh"), "--ep-size", "4"]) == 0
    assert sorted(os.listdir(tmp_path / "fresh")) == [f"checkpoint_last-rank-{r}.pt" for r in range(4)]


def test_a_missing_truncated_or_foreign_rank_file_is_named_in_one_line(tmp_path, capsys):
    rank0 = write_run(tmp_path / "ep2")
    rank1 = tmp_path / "ep2" / "checkpoint_last-rank-1.pt"
    whole = rank1.read_bytes()
    rank1.write_bytes(whole[:len(whole) // 2])
    refused([rank0, tmp_path / "merged.pt"], capsys, str(rank1), "truncated")
    rank1.write_bytes(b"")
    refused([rank0, tmp_path / "merged.pt"], capsys, str(rank1), "truncated")
    torch.save({"weights": torch.zeros(3)}, rank1)
    refused([rank0, tmp_path / "merged.pt"], capsys, str(rank1), "not a fairseq checkpoint of an MoE model")
    os.unlink(rank1)
    refused([rank0, tmp_path / "out", "--ep-size", "4"], capsys, str(rank1), "no such file")
    refused([tmp_path / "nowhere" / "checkpoint_last-rank-0.pt", tmp_path / "merged.pt"], capsys, "no such file")
    assert sorted(contents(tmp_path)) == ["ep2/checkpoint_last-rank-0.pt"]   # nothing written


def test_the_command_exits_2_with_one_line_on_a_truncated_rank_file(tmp_path):
    rank0 = write_run(tmp_path / "ep2")
    rank1 = tmp_path / "ep2" / "checkpoint_last-rank-1.pt"
    rank1.write_bytes(rank1.read_bytes()[:100])
    done = subprocess.run([sys.executable, "-m", "moe_plugin.integrations.fairseq_moe.consolidate", str(rank0),
                           str(tmp_path / "merged.pt")], capture_output=True, text=True, timeout=120)
    # (importing the package imports fairseq, whose import logs a note of its own to stderr: tensorboardX)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("consolidate: ")]
    assert ours == done.stderr.splitlines()[-1:] and str(rank1) in ours[0] and "truncated" in ours[0], done.stderr
