"""What `moe-plugin train` leaves of earlier runs, and what its summary says of a resumed one (issue 58, items 1
and 4): a fresh run into an out_dir that holds another run's checkpoints or metrics refuses in one line (exit
status 2, before torchrun starts under --nproc-per-node), every byte there as it was, unless log.overwrite=true
(replace it) or train.resume (continue it); after resumes on other numbers of processes, the tokens, steps,
processes and seconds of result.json and the summary are summed over the segments."""
import json
import re
import time
from pathlib import Path

import pytest

from moe_plugin import train
from moe_plugin.cli import main
from moe_plugin.train import command

from helpers.train import TINY

QUICK = [*TINY, "log.plots=false", "train.eval_every=2", "train.checkpoint_every=2"]


def files(folder: Path) -> dict:
    """Every file under folder: {relative path: bytes}."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(err: str) -> str:
    assert err.count("\n") == 1, err
    return err


@pytest.fixture
def no_torchrun(monkeypatch):
    monkeypatch.setattr(command.subprocess, "call", lambda argv: pytest.fail(f"torchrun was started: {argv}"))


def test_a_fresh_run_refuses_an_out_dir_that_holds_another_run(tmp_path, capsys, no_torchrun):
    out = tmp_path / "run"
    assert main(["train", *QUICK, "train.steps=4", f"log.out_dir={out}"]) == 0
    assert [p.name for p in train.checkpoints(out)] == ["step_000002", "step_000004"]
    before = files(out)
    capsys.readouterr()

    for launcher in ([], ["--nproc-per-node", "2"]):    # one process; and before torchrun starts
        assert main(["train", *launcher, *QUICK, "train.steps=2", f"log.out_dir={out}"]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"log.out_dir='{out}' holds another run (step_000002, step_000004, metrics.jsonl)" in err
        assert "train.resume=auto" in err and "log.overwrite=true" in err
        assert files(out) == before

    # asked by name: log.overwrite=true replaces that run
    assert main(["train", *QUICK, "train.steps=2", f"log.out_dir={out}", "log.overwrite=true"]) == 0
    assert [p.name for p in train.checkpoints(out)] == ["step_000002"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 2]


def test_metrics_alone_are_another_run_too(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *QUICK, "train.steps=2", "train.checkpoint_every=0", f"log.out_dir={out}"]) == 0
    for folder in train.checkpoints(out):      # as a run whose checkpoints went elsewhere: its metrics remain
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()
    before = files(out)
    capsys.readouterr()
    assert main(["train", *QUICK, "train.steps=2", f"log.out_dir={out}"]) == 2
    assert "holds another run (metrics.jsonl)" in one_line(capsys.readouterr().err)
    assert files(out) == before


def test_auto_with_no_whole_checkpoint_deletes_none_unasked(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *QUICK, "train.steps=2", f"log.out_dir={out}"]) == 0
    shard = train.checkpoints(out)[0] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])    # damaged: auto skips it, and would start fresh over it
    before = files(out)
    capsys.readouterr()
    assert main(["train", *QUICK, "train.steps=2", f"log.out_dir={out}", "train.resume=auto"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("moe-plugin train: train.resume='auto' found no whole checkpoint in")
    assert "would delete step_000002: add log.overwrite=true" in err and "Traceback" not in err
    assert files(out) == before
    assert main(["train", *QUICK, "train.steps=2", f"log.out_dir={out}", "train.resume=auto",
                 "log.overwrite=true"]) == 0
    assert train.verify(train.checkpoints(out)[0]) is None


def test_resume_continues_the_run_it_was_asked_to(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *QUICK, "train.steps=4", "train.stop_at=2", f"log.out_dir={out}"]) == 0
    assert main(["train", *QUICK, "train.steps=4", f"log.out_dir={out}", "train.resume=auto"]) == 0
    assert [p.name for p in train.checkpoints(out)] == ["step_000002", "step_000004"]


def test_overwrite_is_validated_like_the_other_keys():
    with pytest.raises(ValueError, match="log.overwrite"):
        train.load_config(None, ["log.overwrite=maybe"])
    assert train.load_config(None, ["log.overwrite=true"]).log.overwrite is True


# ---- the figures of a resumed run ----------------------------------------------------------------------------

def _segment(rank, world_size, out, overrides):
    import os
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    return train.train(train.load_config(None, [*QUICK, f"log.out_dir={out}", *overrides]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_summary_sums_the_segments_across_layouts(tmp_path):
    """3 steps on 1 process, then to step 5 on 2 processes, then to step 8 on 1: the tokens are each segment's
    steps x processes x rows x seq_len, the time the segments' own, the processes '1 then 2 then 1'."""
    from helpers.launch import run_workers
    out, per_step = tmp_path / "run", 4 * 32    # train.batch_size x model.seq_len (helpers.train.TINY)
    common = ["train.steps=8", "train.resume=auto"]
    walls = []

    def timed(call):
        start = time.perf_counter()
        result = call()
        walls.append(time.perf_counter() - start)
        return result

    first = timed(lambda: train.train(train.load_config(None, [*QUICK, f"log.out_dir={out}", *common,
                                                               "train.stop_at=3"])))
    second = timed(lambda: run_workers(_segment, 2, out, [*common, "train.stop_at=5"], timeout=200)[0])
    third = timed(lambda: train.train(train.load_config(None, [*QUICK, f"log.out_dir={out}", *common])))

    assert [first["tokens"], second["tokens"], third["tokens"]] == \
        [3 * per_step, (3 + 2 * 2) * per_step, (3 + 2 * 2 + 3) * per_step]
    assert third["steps"] == 8 and third["processes"] == [1, 2, 1] and third["world_size"] == 1
    # a segment's time is recorded in the checkpoint it ends with, so before that save: a run's own result, taken
    # after its last save and evaluation, says more for its own segment; every result sums its segments
    segments = third["segments"]
    assert second["segments"][0] == segments[0] and 0 < segments[0]["seconds"] <= first["seconds"]
    assert 0 < segments[1]["seconds"] <= second["segments"][1]["seconds"]
    assert all(0 < segment["seconds"] <= wall for segment, wall in zip(segments, walls))
    for result in (first, second, third):
        assert result["seconds"] == pytest.approx(sum(segment["seconds"] for segment in result["segments"]))
    assert third["seconds"] <= sum(walls)
    assert json.loads((out / "result.json").read_text())["tokens"] == third["tokens"]
    head = (out / "summary.txt").read_text().splitlines()[0]
    assert re.match(rf"run default: 8 steps in 3 segments \(resumed 2 times\), 1 then 2 then 1 process\(es\), "
                    rf"{third['tokens']:,} tokens, {third['seconds']:.0f} s ", head), head


def test_a_checkpoint_without_segments_counts_as_one_of_unknown_time(tmp_path):
    """A checkpoint written before segments were kept: its steps and processes still count, its time is said to
    be missing rather than taken as 0."""
    from moe_plugin.train import manifest
    out, per_step = tmp_path / "run", 4 * 32
    train.train(train.load_config(None, [*QUICK, f"log.out_dir={out}", "train.steps=4", "train.stop_at=2"]))
    folder = train.checkpoints(out)[-1]
    meta = json.loads((folder / "meta.json").read_text())
    del meta["segments"]
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    manifest.write(folder)      # as the older version wrote it: whole, without segments
    result = train.train(train.load_config(None, [*QUICK, f"log.out_dir={out}", "train.steps=4",
                                                  "train.resume=auto"]))
    assert result["tokens"] == 4 * per_step and result["processes"] == [1, 1] and not result["seconds_complete"]
    assert "(and the segments before, whose checkpoint kept no time)" in (out / "summary.txt").read_text()
