"""Checkpoints of `moe-plugin train` on one process: `moe-plugin checkpoint inspect|convert`, a failed
save, and the errors for checkpoints that cannot resume. Other layouts: tests/train/test_checkpoint_reshard.py."""

import pytest
import torch

from moe_plugin import checkpoint, train
from moe_plugin.cli import main
from moe_plugin.train.data import VOCAB_SIZE
from moe_plugin.train.models import TransformerLM

import helpers.train

TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=16", "model.ffn_hidden=48",
        "moe.hidden_size=40", "moe.num_experts=3", "moe.top_k=3", "train.batch_size=3", "train.eval_batches=1",
        "train.warmup_steps=2", "train.steps=8", "train.eval_every=2", "train.checkpoint_every=4", "log.every=1",
        "log.progress=false", "log.plots=false", "moe.gate_noise=0.5", "moe.activation=swiglu"]


def run(tmp_path, name, *overrides):
    return helpers.train.run(tmp_path, *TINY, *overrides, name=name)


def test_convert_to_one_file_and_back_resumes_bit_exactly(tmp_path, fresh_seed, capsys):
    seed = [f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    full, full_records = run(tmp_path, "full", *seed)
    run(tmp_path, "split", *seed, "train.stop_at=6")
    folder = tmp_path / "split" / "checkpoints" / "step_000006"

    assert main(["checkpoint", "convert", str(folder), str(tmp_path / "one.pt")]) == 0
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    assert one["meta"]["step"] == 6 and one["meta"]["world_size"] == 1 and set(one["ranks"]) == {0}
    cfg = train.load_config(None, TINY)
    model = TransformerLM(cfg.model, train.moe_config(cfg), VOCAB_SIZE)
    model.load_state_dict(one["model"])     # strict: the file's model is the model's state dict
    assert set(one["optimizer"]) == {name for name, _ in model.named_parameters()}
    assert all(set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 6
               for state in one["optimizer"].values())
    assert one["scheduler"]["last_epoch"] == 6

    back = tmp_path / "back"
    assert main(["checkpoint", "convert", str(tmp_path / "one.pt"), str(back)]) == 0
    saved, restored = checkpoint.full_state(folder), checkpoint.full_state(back)
    assert saved.keys() == restored.keys()
    for key, value in saved.items():
        assert torch.equal(value, restored[key]) if isinstance(value, torch.Tensor) else value == restored[key], key

    resumed, split_records = run(tmp_path, "split", *seed, f"train.resume={back}")
    for key in ("loss", "val_loss", "tokens_per_expert", "lr"):
        assert [r.get(key) for r in split_records] == [r.get(key) for r in full_records], key
    assert resumed["param_sha256_per_rank"] == full["param_sha256_per_rank"]


def test_inspect_prints_step_layout_and_size(tmp_path, capsys):
    run(tmp_path, "run", "train.steps=4")
    folder = tmp_path / "run" / "checkpoints" / "step_000004"
    assert main(["checkpoint", "inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "step 4, written by 1 process with parallel.ep_size=1" in out
    size_mb = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
    assert f"size: {size_mb:.2f} MB in {len(list(folder.iterdir()))} files" in out
    assert "blocks.1.ffn.experts.w1_EDH [3, 32, 80]: [3, 32, 80] at [0, 0, 0]" in out   # swiglu: 2 x hidden 40
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2
    assert "'" + str(tmp_path / "nothing") + "' does not exist" in capsys.readouterr().err
    assert main(["checkpoint", "convert", str(tmp_path / "run" / "metrics.jsonl"), str(tmp_path / "x")]) == 2
    assert "is not a full checkpoint file" in capsys.readouterr().err


def test_a_failed_save_leaves_the_last_good_checkpoint(tmp_path, fresh_seed, monkeypatch):
    real_save, calls = checkpoint.save, []

    def save_then_fail(state, path):
        calls.append(path)
        if len(calls) == 2:   # the second save dies half-way: some files written, no .metadata
            (path / "__0_0.distcp").write_bytes(b"partial")
            raise OSError("disk full")
        real_save(state, path)

    monkeypatch.setattr(checkpoint, "save", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        run(tmp_path, "run", f"train.seed={fresh_seed}")
    monkeypatch.setattr(checkpoint, "save", real_save)
    out = tmp_path / "run"
    assert [p.name for p in train.checkpoints(out)] == ["step_000004"]
    assert train.resolve_resume("latest", out).name == "step_000004"
    assert (out / "checkpoints" / "step_000008.tmp").exists()       # the remains, under a name never resumed
    result, records = run(tmp_path, "run", f"train.seed={fresh_seed}", "train.resume=latest")
    assert result["steps"] == 8 and [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert [p.name for p in train.checkpoints(out)] == ["step_000004", "step_000008"]
    assert not (out / "checkpoints" / "step_000008.tmp").exists()


def test_checkpoints_that_cannot_resume_say_why(tmp_path):
    run(tmp_path, "run", "train.steps=4")
    folder = tmp_path / "run" / "checkpoints" / "step_000004"
    with pytest.raises(ValueError, match=r"does not fit this model: it holds model\.blocks\.1\.ffn\.router\..* "
                                         r"\(it was written for another model or moe config\)"):
        run(tmp_path, "other", "train.steps=4", "moe.num_experts=6", f"train.resume={folder}")
    with pytest.raises(ValueError, match="does not fit this model: it holds model.blocks.1.ffn.experts.b1_EH, "
                                         "model.blocks.1.ffn.experts.b2_ED, optimizer"):
        run(tmp_path, "other", "train.steps=4", "moe.bias=false", f"train.resume={folder}")
    converted = tmp_path / "one.pt"
    assert main(["checkpoint", "convert", str(folder), str(converted)]) == 0
    with pytest.raises(ValueError, match="is invalid: it is a file, and a checkpoint is a folder"):
        run(tmp_path, "other", f"train.resume={converted}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a checkpoint of `moe-plugin train`: it has no meta.json"):
        run(tmp_path, "other", f"train.resume={tmp_path / 'empty'}")


def _files(path):
    """{relative path: bytes} of every file under a folder, or the bytes of a file."""
    if path.is_file():
        return path.read_bytes()
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_convert_replaces_nothing_unasked_and_never_its_source(tmp_path, capsys):
    """Issue 58 item 2: an existing target (a text file, another checkpoint) is refused without --overwrite, in one
    line with exit status 2, every byte as it was; the source never, even with --overwrite."""
    run(tmp_path, "run", "train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=0")
    two, four = (tmp_path / "run" / "checkpoints" / f"step_00000{s}" for s in (2, 4))
    full = tmp_path / "full.pt"
    assert main(["checkpoint", "convert", str(two), str(full)]) == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    capsys.readouterr()

    refused = [(four, notes, "exists (a file)"), (four, full, "exists (a file)"), (full, four, "exists (a folder)"),
               (four, four, "is the source"), (four, four / "full.pt", "is inside the source"),
               (full, tmp_path, "holds the source")]
    for source, target, why in refused:
        before = {p: _files(p) for p in (source, target, two, four, full, notes) if p.exists()}
        for overwrite in ([], ["--overwrite"]):
            if overwrite and why.startswith("exists"):
                continue
            assert main(["checkpoint", "convert", str(source), str(target), *overwrite]) == 2, (source, target)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"'{target}' {why}" in err, err
            assert {p: _files(p) for p in before} == before
            assert not (four / "full.pt").exists()

    # --overwrite on a kind convert does not write, or a folder that is no checkpoint: refused as well
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("keep\n")
    for source, target in ((four, two), (full, notes), (full, tmp_path / "mine")):
        before = _files(target)
        assert main(["checkpoint", "convert", str(source), str(target), "--overwrite"]) == 2
        assert capsys.readouterr().err.count("\n") == 1 and _files(target) == before

    # asked by name: the target replaced, written whole (no temporary file left beside it)
    assert main(["checkpoint", "convert", str(four), str(notes), "--overwrite"]) == 0
    assert torch.load(notes, weights_only=True)["meta"]["step"] == 4
    assert main(["checkpoint", "convert", str(notes), str(two), "--overwrite"]) == 0
    assert train.read_meta(two)["step"] == 4 and train.verify(two) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt", "mine", "notes.txt", "run"]
    assert sorted(p.name for p in two.parent.iterdir()) == ["step_000002", "step_000004"]
