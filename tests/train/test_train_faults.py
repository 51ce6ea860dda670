"""`moe-plugin train` survives faults: train.resume=auto, checkpoint manifests (damaged checkpoints found, not
loaded), train.keep_checkpoints, preemption signals (SIGTERM, SIGUSR1) and non-finite steps; slow-marked:
the same under torchrun (DDP and FSDP2, ep_size 2), and ranks killed with SIGKILL under torchrun --max-restarts.

Every resumed run is compared with an uninterrupted run of the same config: every model and optimizer tensor
of the final checkpoint, each rank's data position and torch RNG state, and every metrics record but the timings.

What this module tests (moved here from the README):

Tested (tests/train/test_train_faults.py; the slow-marked ones on 2 gloo processes at ep_size 2): torchrun
`--max-restarts 4` while a watcher SIGKILLs a random rank at a random step, one in the middle of a
checkpoint write and one at a random step again: the run ends with every model and optimizer tensor,
data position, torch RNG state and metrics record of an uninterrupted run, bit for bit (3 faults, 3
restarts, 2-4 steps redone per kill with checkpoints every 4 steps; about 65 s with the uninterrupted
run); SIGTERM and SIGUSR1 under torchrun (DDP and FSDP2) and in one process, then a bit-exact resume; a
truncated shard, a flipped bit, an altered byte object, a missing file and a missing manifest; NaN/inf in
the loss, aux loss or one gradient, on one rank of two, under both settings.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_plugin import checkpoint, train
from moe_plugin.cli import main
from moe_plugin.train import loop

from helpers.hf import needs_transformers
from helpers.paths import REPO

ROOT = REPO
TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.hidden_size=48", "moe.num_experts=4", "train.batch_size=4", "train.eval_batches=2",
        "train.warmup_steps=2", "log.progress=false", "log.plots=false", "log.every=1", "train.eval_every=5",
        "moe.gate_noise=0.5"]
TIMINGS = ("tokens_per_s", "images_per_s")


def run(out, *overrides):
    return train.train(train.load_config(None, [*TINY, f"log.out_dir={out}", *overrides]))


def records(out):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def final_checkpoint(out):
    return train.checkpoints(Path(out))[-1]


def assert_same_state(a, b):
    """Two checkpoint folders hold the same step, model, optimizer, LR schedule, data positions and torch RNG."""
    a, b = checkpoint.full_state(a), checkpoint.full_state(b)
    assert sorted(a) == sorted(b)
    tensors = [k for k in a if k.startswith(("model.", "optimizer."))]
    assert any(".experts." in k for k in tensors) and any(k.startswith("optimizer.") for k in tensors)
    for key in tensors:
        assert torch.equal(a[key], b[key]), key
    assert json.loads(a["meta"])["step"] == json.loads(b["meta"])["step"]
    assert train.checkpoint.unpack(a["scheduler"]) == train.checkpoint.unpack(b["scheduler"])
    for key in (k for k in a if k.startswith("rank.")):
        ra, rb = train.checkpoint.unpack(a[key]), train.checkpoint.unpack(b[key])
        # (python's global RNG is saved too, but nothing seeds or uses it: each process starts it from the OS)
        assert same(ra["data"], rb["data"]) and torch.equal(ra["torch_rng"], rb["torch_rng"]), key


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_run(out, reference):
    assert records(out) == records(reference)
    assert_same_state(final_checkpoint(out), final_checkpoint(reference))


# ---- resume=auto, manifests, keep_checkpoints ----------------------------------------------------------------

def test_auto_starts_fresh_then_resumes_bit_exactly(tmp_path, fresh_seed, capsys):
    common = ["train.steps=10", "train.checkpoint_every=4", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    run(tmp_path / "full", *common)
    run(tmp_path / "split", *common, "train.resume=auto", "train.stop_at=5")   # 5: an eval step, as in full
    assert "train.resume=auto: no whole checkpoint in" in capsys.readouterr().err
    run(tmp_path / "split", *common, "train.resume=auto")
    assert f"train.resume=auto: resuming from {tmp_path / 'split' / 'checkpoints' / 'step_000005'}" in \
        capsys.readouterr().err
    assert_same_run(tmp_path / "split", tmp_path / "full")
    manifest = json.loads((final_checkpoint(tmp_path / "split") / "manifest.json").read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "meta.json"}
    assert all(entry["bytes"] > 0 for entry in manifest["files"].values())
    assert "crc32" in manifest["files"][".metadata"] and "crc32" not in manifest["files"]["__0_0.distcp"]
    assert set(manifest["objects"]) == {"meta", "scheduler", "optimizer_param_groups", "rank.0"}


def _truncate(folder):
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    return shard, "bytes, the manifest says"


def _flip(folder):
    """One bit in the middle of the largest tensor's bytes (a byte at a fixed share of the file can land in a
    record's alignment padding, which no sum covers and no load reads)."""
    from torch.distributed.checkpoint import FileSystemReader
    info = max(FileSystemReader(str(folder)).read_metadata().storage_data.values(), key=lambda info: info.length)
    shard = folder / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    return shard, "CRC-32"


def _alter_object(folder):
    """One byte of this process's saved state (data position, RNG states, ...), which is not a tensor record."""
    from torch.distributed.checkpoint import FileSystemReader
    info = next(v for k, v in FileSystemReader(str(folder)).read_metadata().storage_data.items() if k.fqn == "rank.0")
    shard = folder / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard, "rank.0 at byte .*CRC-32"


def _remove_metadata(folder):
    (folder / ".metadata").unlink()
    return folder / ".metadata", "is missing"


def _remove_manifest(folder):
    (folder / "manifest.json").unlink()
    return folder / "manifest.json", "is missing: the save did not finish"


DAMAGE = {"truncated shard": _truncate, "flipped bit": _flip, "altered object": _alter_object,
          "missing file": _remove_metadata, "no manifest": _remove_manifest}


@pytest.fixture(params=["record CRC-32s", "no record CRC-32s"])
def record_crcs(request):
    """torch.save's CRC-32 per record on (the default: the manifest sums small things only) or off (whole files)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(request.param == "record CRC-32s")
    yield request.param
    torch.serialization.set_crc32_options(before)


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_named_not_loaded(tmp_path, damage, capsys, record_crcs):
    run(tmp_path / "run", "train.steps=2")
    manifest = json.loads((final_checkpoint(tmp_path / "run") / "manifest.json").read_text())
    assert ("crc32" in manifest["files"]["__0_0.distcp"]) == (record_crcs == "no record CRC-32s")
    folder = final_checkpoint(tmp_path / "run")
    assert main(["checkpoint", "inspect", str(folder)]) == 0
    assert "manifest: every file's size and every CRC-32 match" in capsys.readouterr().out
    file, why = DAMAGE[damage](folder)
    if record_crcs == "no record CRC-32s" and damage in ("flipped bit", "altered object"):
        why = "has CRC-32 .*, the manifest says"   # the whole file's sum
    with pytest.raises(ValueError, match=f"train.resume='{folder}' is invalid: the checkpoint is damaged: "
                                         f"{re.escape(str(file))}.*{why}"):
        run(tmp_path / "run", "train.steps=4", f"train.resume={folder}")
    assert main(["checkpoint", "inspect", str(folder)]) == 2
    assert f"DAMAGED checkpoint {folder}: {file}" in capsys.readouterr().err
    assert main(["checkpoint", "convert", str(folder), str(tmp_path / "full.pt")]) == 2
    assert not (tmp_path / "full.pt").exists()


def test_auto_skips_damaged_and_unfinished_checkpoints(tmp_path, fresh_seed, capsys):
    common = ["train.steps=12", "train.checkpoint_every=4", "train.keep_checkpoints=0", f"train.seed={fresh_seed}",
              f"data.seed={fresh_seed}"]
    run(tmp_path / "full", *common)
    out = tmp_path / "split"
    run(out, *common, "train.stop_at=9")
    folders = train.checkpoints(out)
    assert [p.name for p in folders] == ["step_000004", "step_000008", "step_000009"]
    _truncate(folders[-1])
    _remove_manifest(folders[-2])    # as a save killed before its last file (and renamed by hand)
    leftover = out / "checkpoints" / "step_000012.tmp"   # a save killed half-way
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")

    run(out, *common, "train.resume=auto")
    log = capsys.readouterr().err
    assert f"skipping step_000012.tmp: {leftover} is the remains of a save that did not finish" in log
    assert f"skipping step_000009: {folders[-1] / '__0_0.distcp'} has " in log
    assert f"skipping step_000008: {folders[-2] / 'manifest.json'} is missing" in log
    assert f"resuming from {folders[0]}" in log
    assert_same_run(out, tmp_path / "full")
    assert train.verify(final_checkpoint(out)) is None


def test_latest_without_a_whole_checkpoint_says_so(tmp_path):
    run(tmp_path / "run", "train.steps=2")
    _truncate(final_checkpoint(tmp_path / "run"))
    with pytest.raises(ValueError, match="train.resume='latest' is invalid: no whole checkpoints in .* "
                                         r"\(train.resume=auto starts fresh then\)"):
        run(tmp_path / "run", "train.steps=2", "train.resume=latest")


def test_keep_checkpoints_removes_old_ones_only_after_a_newer_one_is_whole(tmp_path, monkeypatch):
    run(tmp_path / "run", "train.steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=2")
    assert [p.name for p in train.checkpoints(tmp_path / "run")] == ["step_000004", "step_000006"]

    real_save, calls = checkpoint.save, []

    def fail_third(state, path):
        calls.append(path)
        real_save(state, path)
        if len(calls) == 3:
            raise OSError("disk full")   # after the shards: the folder is complete but for its manifest
    monkeypatch.setattr(checkpoint, "save", fail_third)
    with pytest.raises(OSError, match="disk full"):
        run(tmp_path / "again", "train.steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=1")
    assert [p.name for p in train.checkpoints(tmp_path / "again")] == ["step_000004"]
    assert train.verify(tmp_path / "again" / "checkpoints" / "step_000004") is None


# ---- preemption ----------------------------------------------------------------------------------------------

def signal_at(monkeypatch, step, number=signal.SIGTERM, rank=None):
    """Send `number` to this process in the middle of training step `step` (during its forward)."""
    real, calls = loop.aux_loss, []

    def aux_loss(model):
        calls.append(1)
        if len(calls) == step and (rank is None or int(os.environ.get("RANK", 0)) == rank):
            os.kill(os.getpid(), number)
        return real(model)
    monkeypatch.setattr(loop, "aux_loss", aux_loss)


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_once_and_stops_then_auto_resumes_bit_exactly(tmp_path, fresh_seed, monkeypatch, capsys,
                                                                     number):
    common = ["train.steps=12", "train.checkpoint_every=4", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}",
              "train.resume=auto"]
    run(tmp_path / "full", *common)
    stop = random.Random(fresh_seed).randrange(1, 12)
    signal_at(monkeypatch, stop, number)
    with pytest.raises(train.Preempted) as preempted:
        run(tmp_path / "split", *common)
    name = signal.Signals(number).name
    assert preempted.value.step == stop and preempted.value.signal_name == name
    assert f"preempted by {name}: stopped after step {stop} with checkpoint" in capsys.readouterr().err
    assert train.checkpoints(tmp_path / "split")[-1].name == f"step_{stop:06d}"
    assert train.verify(train.checkpoints(tmp_path / "split")[-1]) is None
    assert records(tmp_path / "split")[-1]["step"] == stop
    assert signal.getsignal(number) is signal.SIG_DFL or signal.getsignal(number) == signal.default_int_handler
    monkeypatch.undo()
    run(tmp_path / "split", *common)
    assert_same_run(tmp_path / "split", tmp_path / "full")


def test_a_signal_during_a_save_keeps_that_checkpoint_and_stops_with_it(tmp_path, fresh_seed, monkeypatch):
    common = ["train.steps=12", "train.checkpoint_every=4", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}",
              "train.resume=auto", "train.keep_checkpoints=1"]
    run(tmp_path / "full", *common)
    real_save = checkpoint.save

    def signalled_save(state, path):
        if path.name == "step_000008.tmp":
            os.kill(os.getpid(), signal.SIGTERM)   # in the middle of the save: it goes on to the end
        real_save(state, path)
    monkeypatch.setattr(checkpoint, "save", signalled_save)
    with pytest.raises(train.Preempted) as preempted:
        run(tmp_path / "split", *common)
    assert preempted.value.step == 8   # not one step later: no second checkpoint
    assert [p.name for p in train.checkpoints(tmp_path / "split")] == ["step_000008"]
    assert train.verify(tmp_path / "split" / "checkpoints" / "step_000008") is None
    assert not list((tmp_path / "split" / "checkpoints").glob("*.tmp"))
    monkeypatch.undo()
    run(tmp_path / "split", *common)
    assert_same_run(tmp_path / "split", tmp_path / "full")


def test_the_command_exits_with_the_preemption_code(tmp_path, monkeypatch, capsys):
    signal_at(monkeypatch, 2)
    assert main(["train", *TINY, "train.steps=5", f"log.out_dir={tmp_path}"]) == train.PREEMPTED_EXIT_CODE == 75
    assert "preempted by SIGTERM: stopped after step 2" in capsys.readouterr().err


# ---- non-finite steps ----------------------------------------------------------------------------------------

def poison(monkeypatch, what, steps, rank=None):
    """Make the loss, the aux loss or one gradient NaN/inf at the given training steps (1-based; on one rank)."""
    step = [0]
    real_aux, real_build = loop.aux_loss, loop.build

    def hit():
        return step[0] in steps and (rank is None or int(os.environ.get("RANK", 0)) == rank)

    def count(module, args):
        step[0] += module.training   # one training forward per step

    def aux_loss(model):
        return real_aux(model) * float("nan") if what == "aux loss" and hit() else real_aux(model)

    def build(cfg, procs):
        parts = real_build(cfg, procs)
        parts.model.register_forward_pre_hook(count)
        if what == "loss":
            parts.model.register_forward_hook(
                lambda module, args, out: out * float("nan") if module.training and hit() else out)
        if what == "gradient norm":   # a gradient only: the loss is finite
            weight = parts.model.blocks[0].attn_norm.weight
            weight.register_hook(lambda grad: grad * float("inf") if hit() else grad)
        return parts
    monkeypatch.setattr(loop, "aux_loss", aux_loss)
    monkeypatch.setattr(loop, "build", build)


@pytest.mark.parametrize("what", ["loss", "aux loss", "gradient norm"])
def test_a_nonfinite_step_is_skipped_and_counted(tmp_path, fresh_seed, monkeypatch, what):
    poison(monkeypatch, what, {5})
    out = tmp_path / "run"
    result = run(out, "train.steps=8", "train.checkpoint_every=1", "train.keep_checkpoints=0",
                 f"train.seed={fresh_seed}")
    # nothing of step 5 reached the weights or AdamW's state: its checkpoint equals step 4's
    before, skipped, after = (checkpoint.full_state(out / "checkpoints" / f"step_{s:06d}") for s in (4, 5, 6))
    tensors = [k for k in before if k.startswith(("model.", "optimizer."))]
    assert all(torch.equal(before[k], skipped[k]) for k in tensors)
    assert not all(torch.equal(skipped[k], after[k]) for k in tensors)
    assert all(torch.isfinite(after[k]).all() for k in tensors)
    by_step = {r["step"]: r for r in records(out)}
    assert by_step[5]["skipped_steps"] == 1 and "loss" not in by_step[5] and "tokens_per_expert" not in by_step[5]
    assert all(by_step[s]["skipped_steps"] == 0 and "loss" in by_step[s] for s in (1, 2, 3, 4, 6, 7, 8))
    assert result["skipped_steps"] == 1
    assert "skipped steps (non-finite loss, aux loss or gradient norm): 1" in (out / "summary.txt").read_text()


@pytest.mark.parametrize("what", ["loss", "aux loss", "gradient norm"])
def test_nonfinite_stop_names_the_step_and_keeps_the_last_checkpoint(tmp_path, fresh_seed, monkeypatch, what):
    poison(monkeypatch, what, {6})
    out = tmp_path / "run"
    with pytest.raises(train.NonFiniteStep, match=f"step 6: the {what}( and gradient norm)? (is|are) not finite"):
        run(out, "train.steps=8", "train.checkpoint_every=4", "train.nonfinite=stop", f"train.seed={fresh_seed}")
    assert [p.name for p in train.checkpoints(out)] == ["step_000004"]
    assert train.verify(out / "checkpoints" / "step_000004") is None
    assert max(r["step"] for r in records(out)) == 5


def test_max_skipped_in_a_row_stops(tmp_path, monkeypatch, capsys):
    poison(monkeypatch, "loss", {3, 5, 6, 7})
    out = tmp_path / "run"
    assert main(["train", *TINY, "train.steps=9", "train.max_skipped=3", f"log.out_dir={out}"]) == \
        train.NONFINITE_EXIT_CODE
    assert "step 7: the loss and gradient norm are not finite (NaN or inf): 3 steps in a row skipped, " \
           "train.max_skipped=3" in capsys.readouterr().err
    assert [r.get("skipped_steps") for r in records(out)[1:]] == [0, 0, 1, 0, 1, 1]


def test_bad_fault_settings_name_the_key():
    with pytest.raises(ValueError, match="train.nonfinite='ignore' is invalid: must be one of 'skip', 'stop'"):
        train.load_config(None, ["train.nonfinite=ignore"])
    with pytest.raises(ValueError, match="train.max_skipped=0 is invalid: must be >= 1"):
        train.load_config(None, ["train.max_skipped=0"])
    with pytest.raises(SystemExit):
        main(["train", "--max-restarts", "x"])


def test_max_restarts_needs_the_launcher(capsys):
    assert main(["train", "--max-restarts", "3"]) == 2
    assert "--max-restarts=3 is applied by torchrun: add --nproc-per-node N" in capsys.readouterr().err
    assert "--max-restarts" not in train.processes.torchrun_command(2, None, [])
    assert train.processes.torchrun_command(2, None, ["a=1"], 4)[-7:-4] == ["2", "--max-restarts", "4"]
    with pytest.raises(ValueError, match="--max-restarts=-1 is invalid: must be an integer >= 0"):
        train.processes.torchrun_command(2, None, [], -1)


# ---- several processes (slow) --------------------------------------------------------------------------------

def launch(out, *arguments, launcher=(), restarts=None):
    """`moe-plugin train` on 2 processes under torchrun (started by `moe-plugin train --nproc-per-node 2`, or
    torchrun itself with --max-restarts `restarts`), writing to out; the Popen, its output in out.parent."""
    if restarts is None:
        command = [sys.executable, "-m", "moe_plugin.cli", "train", "--nproc-per-node", "2"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "--max-restarts", str(restarts), "-m", "moe_plugin.cli", "train"]
    command += [*TINY, *arguments, f"log.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(f"{out}.log", "w")
    return subprocess.Popen(command, cwd=out.parent, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc, timeout=240):
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def last_step(out):
    try:
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else -1
    except (FileNotFoundError, ValueError):
        return -1


def ranks(torchrun_pid):
    """{rank: pid} of torchrun's worker processes now."""
    found = {}
    for children in Path(f"/proc/{torchrun_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in item)
            except (FileNotFoundError, ProcessLookupError):
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = int(pid)
    return found


PARALLEL = {"ddp ep2": ["parallel.ep_size=2"], "fsdp2 ep2": ["parallel.ep_size=2", "parallel.fsdp=true"]}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout, number", [("ddp ep2", signal.SIGTERM), ("fsdp2 ep2", signal.SIGUSR1)])
def test_preemption_under_torchrun(tmp_path, fresh_seed, layout, number):
    """The signal goes to `moe-plugin train --nproc-per-node 2`, which hands it to torchrun, which hands it to
    the ranks: they finish the step, write one checkpoint and exit 75; the same command resumes bit-exactly."""
    common = [*PARALLEL[layout], "train.steps=30", "train.checkpoint_every=8", "train.resume=auto",
              f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    assert finish(launch(tmp_path / "full", *common)) == 0
    proc = launch(tmp_path / "split", *common)
    target = random.Random(fresh_seed).randrange(3, 20)
    while last_step(tmp_path / "split") < target and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(number)
    assert finish(proc) == train.PREEMPTED_EXIT_CODE   # each rank's, not torchrun's traceback (issue 58 item 9)
    log = (tmp_path / "split.log").read_text()
    name = signal.Signals(number).name
    stopped = re.search(f"preempted by {name}: stopped after step (\\d+)", log)
    assert stopped, log[-3000:]
    # the run ends with the one line saying where it saved and how to resume: no torchrun traceback or log lines
    last = log.splitlines()[-1]
    assert last.startswith("moe-plugin train: " + stopped.group(0)) and last.endswith("train.resume=auto to go on"), log[-3000:]
    assert "Traceback" not in log and "torch/distributed/elastic" not in log, log[-3000:]
    step = int(stopped.group(1))
    assert step >= target
    assert train.checkpoints(tmp_path / "split")[-1].name == f"step_{step:06d}"
    assert not list((tmp_path / "split" / "checkpoints").glob("*.tmp"))
    assert finish(launch(tmp_path / "split", *common)) == 0
    assert f"resuming from {tmp_path / 'split' / 'checkpoints'}/step_{step:06d}" in \
        (tmp_path / "split.log").read_text()
    assert_same_run(tmp_path / "split", tmp_path / "full")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_error_the_ranks_find_ends_in_their_line_not_torchruns_traceback(tmp_path):
    """A ValueError found once the processes run (train.resume=latest with nothing to resume): exit status 2 and
    the ranks' one line (each rank says it), without torchrun's ChildFailedError."""
    out = tmp_path / "empty"
    assert finish(launch(out, "train.resume=latest")) == 2
    lines = set(Path(f"{out}.log").read_text().splitlines())
    assert lines == {f"moe-plugin train: train.resume='latest' is invalid: no checkpoints in {out / 'checkpoints'} "
                     f"(train.resume=auto starts fresh then)"}, lines


def _nan_on_one_rank(rank, world_size, out, seed):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    poison(pytest.MonkeyPatch(), "loss", {3}, rank=1)   # a spawned process: nothing to undo
    return run(out, "parallel.ep_size=2", "train.steps=5", "train.checkpoint_every=1", "train.keep_checkpoints=0",
               f"train.seed={seed}")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_rank_skips_a_step_that_is_nonfinite_on_one_rank(tmp_path, fresh_seed):
    from helpers.launch import run_workers
    out = tmp_path / "run"
    result, _ = run_workers(_nan_on_one_rank, 2, out, fresh_seed, timeout=150)
    assert result["skipped_steps"] == 1 and result["world_size"] == 2
    assert result["shared_param_sha256_per_rank"][0] == result["shared_param_sha256_per_rank"][1]
    before, skipped, after = (checkpoint.full_state(out / "checkpoints" / f"step_{s:06d}") for s in (2, 3, 4))
    tensors = [k for k in before if k.startswith(("model.", "optimizer."))]
    assert all(torch.equal(before[k], skipped[k]) for k in tensors)   # every rank's experts too
    assert not all(torch.equal(skipped[k], after[k]) for k in tensors)
    assert {r["step"]: r["skipped_steps"] for r in records(out) if r["step"]} == {1: 0, 2: 0, 3: 1, 4: 0, 5: 0}


STARTS = re.compile(r"train\.resume=auto: (?:resuming from \S+/step_(\d+)|no whole checkpoint)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ranks_killed_at_random_steps_and_mid_save_change_nothing(tmp_path, fresh_seed):
    """torchrun --max-restarts 4 on 2 processes at ep_size 2, train.resume=auto; a watcher SIGKILLs a random rank
    at a random step, then while a checkpoint is being written (its folder still .tmp, no .metadata yet), then
    at a random step again. The run ends with the final parameters, optimizer state, data positions and metrics
    of an uninterrupted run, bit for bit."""
    common = ["parallel.ep_size=2", "train.steps=36", "train.checkpoint_every=4", "train.keep_checkpoints=2",
              "train.resume=auto", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    assert finish(launch(tmp_path / "clean", *common, restarts=0)) == 0
    out, rng = tmp_path / "faulty", random.Random(fresh_seed)
    proc = launch(out, *common, restarts=4)
    plan, kills = ["step", "save", "step"], []
    target, fresh = None, False
    deadline = time.time() + 500
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.003)
        starts = STARTS.findall(Path(f"{out}.log").read_text())
        if len(starts) != len(kills) + 1 or len(kills) == len(plan):
            continue   # the attempt after the last kill has not started (or nothing is left to do)
        resumed, pids, step = int(starts[-1] or 0), ranks(proc.pid), last_step(out)
        if len(pids) < 2:
            continue
        # metrics.jsonl still shows the killed attempt's steps until the new attempt cuts it back to `resumed`
        fresh = fresh or not kills or step <= resumed or step > kills[-1]["step"]
        if target is None:
            target = min(resumed + rng.randint(2, 6), 35)
        if plan[len(kills)] == "step":
            due, writing = fresh and step >= target, None
        else:
            writing = step   # this attempt's save of the step it has just logged, not a killed attempt's remains
            tmp = out / "checkpoints" / f"step_{step:06d}.tmp"
            due = fresh and step > resumed and tmp.is_dir() and not (tmp / ".metadata").exists()
        if not due:
            continue
        rank = rng.randrange(2)
        os.kill(pids[rank], signal.SIGKILL)
        kills.append({"kind": plan[len(kills)], "rank": rank, "step": last_step(out), "writing": writing})
        target, fresh = None, False
    assert finish(proc, timeout=max(1, deadline - time.time())) == 0, Path(f"{out}.log").read_text()[-3000:]

    starts = [int(s or 0) for s in STARTS.findall(Path(f"{out}.log").read_text())]
    assert len(kills) == len(plan) and len(starts) == len(kills) + 1, (kills, starts)   # one restart per kill
    for kill, resumed in zip(kills, starts[1:]):
        kill["redone"] = kill["step"] - resumed
        assert 0 <= kill["redone"] < 4 + 2, (kill, resumed)   # at most the steps since the last checkpoint
        if kill["kind"] == "save":   # the checkpoint being written never became one: resumed from the one before
            assert resumed < kill["writing"], (kill, resumed)
    print(f"faults survived: {len(kills)}, restarts: {len(starts) - 1}, kills: {kills}")
    assert_same_run(out, tmp_path / "clean")
    result, clean = (json.loads((d / "result.json").read_text()) for d in (out, tmp_path / "clean"))
    assert result["param_sha256_per_rank"] == clean["param_sha256_per_rank"]


@needs_transformers
def test_upcycling_takes_the_newest_whole_dense_checkpoint(tmp_path, fresh_seed):
    configs = ROOT / "configs" / "experiments"
    hf = ["hf.hidden_size=32", "hf.intermediate_size=40", "hf.num_attention_heads=2", "hf.num_key_value_heads=1",
          "model.seq_len=32", "train.batch_size=4", "train.eval_batches=2", "log.progress=false", "log.plots=false",
          f"data.seed={fresh_seed}", f"train.seed={fresh_seed}"]
    dense = tmp_path / "dense"
    train.train(train.load_config(str(configs / "llama_dense_tiny.yaml"),
                                  [*hf, f"log.out_dir={dense}", "train.steps=4", "train.eval_every=2",
                                   "train.checkpoint_every=2", "train.lr=0.01"]))
    val = {r["step"]: r["val_loss"] for r in records(dense) if "val_loss" in r}
    _truncate(dense / "checkpoints" / "step_000004")

    def upcycle(where):
        cfg = train.load_config(str(configs / "llama_upcycled.yaml"),
                                [*hf, f"log.out_dir={tmp_path / 'up'}", f"upcycle.checkpoint={where}", "train.steps=1",
                                 "log.overwrite=true"])   # each call a fresh run into the same out_dir
        return train.train(cfg)
    # step 0 of the upcycled run is the dense model of step 2 (exact copies, normalized top-2, dropless)
    assert upcycle(dense)["val_loss_first"] == pytest.approx(val[2], abs=1e-5) != pytest.approx(val[4], abs=1e-5)
    with pytest.raises(ValueError, match="upcycle.checkpoint=.*step_000004' is invalid: the checkpoint is damaged: "
                                         ".*__0_0.distcp has .* bytes"):
        upcycle(dense / "checkpoints" / "step_000004")
