"""`moe-plugin train`: config loading and errors, learning, outputs, exact resume, two processes
(data parallel, and expert parallel against one process on the global batch)."""
import json
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from moe_plugin import aux_loss, checkpoint, train
from moe_plugin.cli import main
from moe_plugin.train.data import VOCAB_SIZE, make_data
from moe_plugin.train.models import TransformerLM
from moe_plugin.parallel.expert_grads import expert_layers

from helpers.launch import run_workers, torchrun_train
from helpers.train import ROOT, TINY, run

DEFAULT_YAML = ROOT / "configs" / "experiments" / "default.yaml"


def test_default_yaml_is_the_builtin_default():
    assert train.load_config(str(DEFAULT_YAML)) == train.load_config()


def test_overrides_take_effect(tmp_path, fresh_seed):
    cfg = train.load_config(str(DEFAULT_YAML), ["moe.num_experts=16", "train.steps=200", "data.path=null"])
    assert cfg.moe["num_experts"] == 16 and cfg.train.steps == 200 and cfg.model.dim == 128
    assert train.moe_config(cfg).num_experts == 16 and train.moe_config(cfg).model_dim == 128

    _, records = run(tmp_path, *TINY, "moe.num_experts=3", "moe.top_k=1", "train.steps=4", "log.every=2",
                     f"train.seed={fresh_seed}")
    assert [r["step"] for r in records] == [0, 2, 4]
    assert all(len(load) == 3 for r in records[1:] for load in r["tokens_per_expert"])
    assert all(sum(load) == 2 * 4 * 32 for r in records[1:] for load in r["tokens_per_expert"])  # top-1, 2 steps


@pytest.mark.parametrize("override, expected", [
    ("train.stepz=3", "unknown key 'train.stepz' (did you mean 'steps'?); valid keys of section train: steps, stop_at,"),
    ("modle.dim=64", "unknown key 'modle' (did you mean 'model'?); valid keys of the config: model, moe, data, train,"),
    ("moe.num_expert=4", "unknown key 'moe.num_expert' (did you mean 'num_experts'?); valid keys of section moe: "
                         "hidden_size, num_experts,"),
    ("moe.model_dim=64", "moe.model_dim is set by model.dim"),
    ("moe.ep_size=2", "moe.ep_size is set by parallel.ep_size"),
])
def test_unknown_key_lists_the_valid_keys(override, expected):
    with pytest.raises(ValueError) as error:
        train.load_config(str(DEFAULT_YAML), [override])
    assert expected in str(error.value)
    assert "model_dim," not in str(error.value) and "ep_size," not in str(error.value)


def test_unknown_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 5\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match="unknown key 'train.learning_rate'.*valid keys of section train: steps"):
        train.load_config(str(path))


@pytest.mark.parametrize("override, expected", [
    ("train.steps=-5", "train.steps=-5 is invalid: must be >= 1"),
    ("train.steps=abc", "train.steps: Value 'abc' of type 'str' could not be converted to Integer"),
    ("data.path=/no/such/file.txt", "data.path='/no/such/file.txt' is invalid: no such file"),
    ("model.heads=3", "model.heads=3 is invalid: must be a divisor of model.dim=128"),
    ("train.stop_at=601", "train.stop_at=601 is invalid: must be null or between 1 and train.steps=600"),
    ("parallel.ep_size=3", "parallel.ep_size=3 is invalid: ep_size=3 cannot hold num_experts=8 with hidden_size=256: "
                           "ep_size must divide num_experts, or be a multiple of it"),
    ("moe.top_k=9", "moe section: MoEConfig.top_k=9 is invalid"),
    ("moe.activation=tanh", "moe section: MoEConfig.activation='tanh' is invalid"),
])
def test_bad_values_name_the_key_and_value(override, expected):
    with pytest.raises(ValueError) as error:
        train.load_config(None, [override])
    assert expected in str(error.value)


def test_command_line_reports_config_errors(capsys):
    assert main(["train", "train.stepz=3"]) == 2
    assert "unknown key 'train.stepz'" in capsys.readouterr().err
    assert main(["train", *TINY, "parallel.ep_size=2"]) == 2
    assert "parallel.ep_size=2 is invalid: must divide the number of processes, 1 (launch with torchrun" in \
        capsys.readouterr().err
    assert main(["train", "a.yaml", "b.yaml"]) == 2
    assert main(["train", str(DEFAULT_YAML), "moe.num_experts=16", "--print-config"]) == 0
    assert "num_experts: 16" in capsys.readouterr().out


@pytest.mark.parametrize("arguments, message", [
    (["--nproc-per-node", "2", "parallel.ep_size=4"],
     "parallel.ep_size=4 is invalid: must divide the number of processes, 2 (--nproc-per-node 2; start N with "
     "--nproc-per-node N, N a multiple of 4; or set parallel.ep_size to one of [1, 2])"),
    (["--nproc-per-node", "6", "parallel.ep_size=3"],    # 3 divides 6, but not the 4 experts
     "parallel.ep_size=3 cannot hold num_experts=4 with hidden_size=48"),
    (["--nproc-per-node", "1", "parallel.fsdp=true"], "parallel.fsdp=true is invalid with --nproc-per-node 1"),
])
def test_the_launcher_checks_the_config_against_its_world_before_torchrun_starts(monkeypatch, capsys, tmp_path,
                                                                                 arguments, message):
    """Issue 58 item 6: one line, exit status 2, and torchrun never started; the values suggested are accepted."""
    from moe_plugin.train import command
    monkeypatch.setattr(command.subprocess, "call", lambda argv: pytest.fail(f"torchrun was started: {argv}"))
    assert main(["train", *arguments[:2], *TINY, *arguments[2:], f"log.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    if "one of" in err:
        nproc = int(arguments[1])
        for ep_size in json.loads(err.rsplit("one of ", 1)[1].split("]")[0] + "]"):
            cfg = train.load_config(None, [*TINY, f"parallel.ep_size={ep_size}"], world=command.launch_world(nproc))
            command.check_launch(cfg, nproc)      # accepted


def test_the_launcher_refuses_in_one_line_in_a_real_process(tmp_path):
    import subprocess
    done = subprocess.run([sys.executable, "-m", "moe_plugin.cli", "train", "--nproc-per-node", "2", *TINY,
                           "parallel.ep_size=4", f"log.out_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("moe-plugin train: parallel.ep_size=4 is invalid: must divide the number of "
                                  "processes, 2 (--nproc-per-node 2;")
    assert not (tmp_path / "run").exists()


def test_default_config_learns_and_writes_its_outputs(tmp_path, fresh_seed):
    """The default model and corpus for a few steps: validation loss falls well below its start."""
    result, records = run(tmp_path, "train.steps=24", "train.warmup_steps=4", "train.eval_every=12",
                          "log.every=4", "log.progress=false", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}")
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0] - 1.0, val
    first, last = records[1], records[-1]
    assert last["loss"] < first["loss"] - 0.5
    assert set(last) >= {"step", "lr", "loss", "aux_loss", "tokens_per_s", "dropped_fraction", "tokens_per_expert"}
    assert len(last["tokens_per_expert"]) == 2 and all(len(load) == 8 for load in last["tokens_per_expert"])
    out = tmp_path / "run"
    for name in ("loss.png", "expert_load.png", "summary.txt", "result.json", "config.yaml"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    summary = (out / "summary.txt").read_text()
    assert "validation loss" in summary and "arithmetic" in summary and "upper_words" in summary
    assert result["val_loss_last"] == val[-1] and result["world_size"] == 1
    assert [p.name for p in train.checkpoints(out)] == ["step_000024"]


def write_text_file(path):
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]
    path.write_text("".join(f"{words[i % 6]} {words[(i * 7) % 6]} {i % 10}.\n" for i in range(2000)))
    return path


@pytest.mark.parametrize("data", ["synthetic", "text file"])
def test_resume_continues_bit_exactly(tmp_path, fresh_seed, data):
    common = [*TINY, "train.steps=12", "train.eval_every=3", "train.checkpoint_every=4", "log.every=1",
              "moe.gate_noise=0.5", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    if data == "text file":
        common.append(f"data.path={write_text_file(tmp_path / 'corpus.txt')}")
    full, full_records = run(tmp_path, *common, name="full")
    run(tmp_path, *common, "train.stop_at=6", name="split")
    assert [p.name for p in train.checkpoints(tmp_path / "split")] == ["step_000004", "step_000006"]
    resumed, split_records = run(tmp_path, *common, "train.resume=latest", name="split")

    assert len(full_records) == 13
    for key in ("loss", "aux_loss", "val_loss", "dropped_fraction", "tokens_per_expert", "lr"):
        assert [r.get(key) for r in split_records] == [r.get(key) for r in full_records], key
    assert resumed["param_sha256_per_rank"] == full["param_sha256_per_rank"]
    assert not list((tmp_path / "split" / "checkpoints").glob("*.tmp"))


def test_resume_errors(tmp_path):
    cfg = train.load_config(None, [*TINY, f"log.out_dir={tmp_path}", "train.resume=latest"])
    with pytest.raises(ValueError, match="train.resume='latest' is invalid: no checkpoints in"):
        train.train(cfg)
    cfg = train.load_config(None, [*TINY, "train.resume=/no/such.pt"])
    with pytest.raises(ValueError, match="train.resume='/no/such.pt' is invalid: no such file"):
        train.train(cfg)


def test_text_file_data_learns(tmp_path, fresh_seed):
    path = write_text_file(tmp_path / "corpus.txt")
    _, records = run(tmp_path, *TINY, f"data.path={path}", "train.steps=30", "train.eval_every=30", "train.lr=0.01",
                     f"train.seed={fresh_seed}")
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val[-1] < val[0] - 1.0, val


def test_tensorboard_writer_is_skipped_when_tensorboard_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert train.tensorboard_writer(tmp_path) is None
    run(tmp_path, *TINY, "train.steps=2", "log.plots=false")
    assert not (tmp_path / "run" / "tensorboard").exists()


@pytest.mark.timeout(240)
def test_two_processes_train_identical_replicas(tmp_path, fresh_seed):
    out = tmp_path / "ddp"
    result, _ = torchrun_train(out, *TINY, "train.steps=16", "train.eval_every=16", "train.lr=0.01",
                               "log.plots=false", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}")
    assert result["world_size"] == 2 and result["steps"] == 16
    hashes = result["param_sha256_per_rank"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert result["val_loss_last"] < result["val_loss_first"] - 0.5
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 10, 16]
    assert sum(records[-1]["tokens_per_expert"][0]) == 6 * 2 * (4 * 32) * 2  # steps x ranks x tokens x top-k
    saved = checkpoint.full_state(out / "checkpoints" / "step_000016")
    ranks = [train.checkpoint.unpack(saved[f"rank.{r}"]) for r in range(2)]
    assert ranks[0]["data"]["rng"] != ranks[1]["data"]["rng"]  # each rank reads its own stream


def expert_share(full, name, layout):
    """The part of a one-process expert tensor that a rank holds; b2 is the first hidden slice's alone."""
    part = full[layout.first_expert:layout.first_expert + layout.local_experts]
    S, s = layout.slices, layout.slice_index
    if S == 1:
        return part
    if name.endswith("b2_ED"):
        return part if s == 0 else torch.zeros_like(part)
    return part.chunk(S, dim=1 if name.endswith("w2_EHD") else -1)[s]


def _expert_parallel_step(rank, world_size, seed, cases):
    """One step of the trainer's model with parallel.ep_size=2 (its DDP wrapping, gradient clipping and
    optimizer) against one process on the concatenated batch; relative errors by case and tensor."""
    results = {}
    for case, overrides in cases.items():
        # dropless and no balance loss: the loss is then the same mean over tokens however they are split
        common = [*TINY, "moe.capacity_factor=0", "moe.aux_loss_coef=0", f"train.seed={seed}",
                  *overrides]
        procs = train.Processes(rank, world_size, torch.device("cpu"), False)
        parts = train.build(train.load_config(None, [*common, "parallel.ep_size=2"]), procs)
        one = train.build(train.load_config(None, common), train.Processes(0, 1, torch.device("cpu"), False))
        model, reference = parts.model.double(), one.model.double()
        wrapped = train.data_parallel(model, procs)

        generator = torch.Generator().manual_seed(seed)
        x_WBS, y_WBS = torch.randint(0, VOCAB_SIZE, (2, world_size, 4, 32), generator=generator)
        loss = F.cross_entropy(wrapped(x_WBS[rank]).flatten(0, 1), y_WBS[rank].flatten()) + aux_loss(model)
        loss.backward()
        loss = F.cross_entropy(reference(x_WBS.flatten(0, 1)).flatten(0, 1), y_WBS.flatten()) + aux_loss(reference)
        loss.backward()

        errors = {}
        layouts = {prefix: layer.groups.layout for prefix, layer in expert_layers(model)}
        references = dict(reference.named_parameters())
        norm = train.clip_gradients(model, 0.05, procs, ep_size=2)
        errors["norm"] = abs(float(norm / torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)) - 1)
        for name, param in model.named_parameters():
            want = references[name].grad
            prefix = name.rpartition("experts.")[0]
            if prefix in layouts:
                want = expert_share(want, name, layouts[prefix])
            got = torch.zeros_like(want) if param.grad is None else param.grad  # b2 unused outside slice 0
            errors[f"grad {name}"] = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))

        parts.optimizer.step()
        one.optimizer.step()
        full = train.full_state_dict(model)
        for name, want in reference.state_dict().items():
            errors[f"after step {name}"] = float((full[name] - want).abs().max() / want.abs().max().clamp(min=1e-30))
        results[case] = errors
    return results


EP_CASES = {"2 experts per rank": [], "sliced expert": ["moe.num_experts=1", "moe.top_k=1"],
            "sliced expert, r=2": ["moe.num_experts=1", "moe.top_k=1", "moe.parallel=2"]}


@pytest.mark.timeout(150)
def test_expert_parallel_step_matches_one_process_on_the_global_batch(fresh_seed):
    """4 processes, 2 ep groups: shared gradients averaged by DDP, expert gradients summed over the 2
    replicas and scaled by 1 / 4, the clipping norm over all experts, and the gathered checkpoint
    state after an AdamW step."""
    results = run_workers(_expert_parallel_step, 4, fresh_seed, EP_CASES, timeout=120)
    for rank, by_case in enumerate(results):
        for case, errors in by_case.items():
            assert any(name.startswith("grad blocks.1.ffn.experts.") for name in errors)
            worst = max(errors, key=errors.get)
            assert errors[worst] < 1e-9, (rank, case, worst, errors[worst])


def torchrun(out, *overrides, timeout=120):
    return torchrun_train(out, *TINY, *overrides, timeout=timeout)


@pytest.mark.timeout(240)
def test_two_processes_expert_parallel_learn_and_resume_bit_exactly(tmp_path, fresh_seed):
    common = ["parallel.ep_size=2", "train.steps=16", "train.eval_every=3", "train.checkpoint_every=4",
              "train.keep_checkpoints=0", "log.every=2", "train.lr=0.01", "moe.gate_noise=0.5", "log.plots=false",
              f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    full, full_records = torchrun(tmp_path / "full", *common)
    assert full["world_size"] == 2 and full["steps"] == 16
    assert full["val_loss_last"] < full["val_loss_first"] - 0.5
    shared, everything = full["shared_param_sha256_per_rank"], full["param_sha256_per_rank"]
    assert shared[0] == shared[1] and everything[0] != everything[1]   # each rank holds its own experts
    steps = full_records[-1]["step"] - full_records[-2]["step"]
    assert sum(full_records[-1]["tokens_per_expert"][0]) == steps * 2 * (4 * 32) * 2  # both ranks' tokens, top-2

    # the checkpoint holds every expert: one process loads it and gets the run's last validation loss
    state = checkpoint.nest(checkpoint.full_state(tmp_path / "full" / "checkpoints" / "step_000016"))
    assert state["model"]["blocks.1.ffn.experts.w1_EDH"].shape[0] == 4
    cfg = train.load_config(None, [*TINY, f"data.seed={fresh_seed}"])
    model = TransformerLM(cfg.model, train.moe_config(cfg), VOCAB_SIZE)
    model.load_state_dict(state["model"])
    data = make_data(cfg.data, cfg.train.batch_size, cfg.model.seq_len, cfg.train.eval_batches)
    assert train.evaluate(model, data.val, torch.device("cpu")) == pytest.approx(full["val_loss_last"], rel=1e-5)

    # a fresh launch resumes the run from its step-4 checkpoint (copied to a folder of its own, with the metrics the
    # run had written by then, as a run stopped there leaves them, marked) and goes on to step 16 as the run did
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_000004", split / "checkpoints" / "step_000004")
    (split / "metrics.jsonl").write_text("".join(json.dumps({**r, "before": True}) + "\n"
                                                 for r in full_records if r["step"] <= 4))
    resumed, split_records = torchrun(split, *common, "train.resume=latest")
    assert [r["step"] for r in split_records if r.get("before")] == [0, 2, 3, 4]   # resumed, not started afresh
    assert [p.name for p in train.checkpoints(split)] == [f"step_{s:06d}" for s in (4, 8, 12, 16)]
    for key in ("loss", "aux_loss", "val_loss", "dropped_fraction", "tokens_per_expert", "lr"):
        assert [r.get(key) for r in split_records] == [r.get(key) for r in full_records], key
    assert resumed["param_sha256_per_rank"] == full["param_sha256_per_rank"]


def test_weight_decay_falls_on_weight_matrices_only():
    cfg = train.load_config(None, ["moe.bias=true"])
    model = TransformerLM(cfg.model, train.moe_config(cfg), VOCAB_SIZE)
    decay, no_decay = train.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    spared = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decayed | spared == set(names.values()) and not decayed & spared
    assert any(n.endswith("experts.w1_EDH") for n in decayed) and any(n.endswith("experts.w2_EHD") for n in decayed)
    assert any(n.endswith("experts.b1_EH") for n in spared) and any(n.endswith("experts.b2_ED") for n in spared)
    assert all(model.get_parameter(n).dim() >= 2 for n in decayed)


def test_summary_lists_plots_only_when_drawn(tmp_path, fresh_seed):
    run(tmp_path, "train.steps=2", "train.eval_every=2", "log.every=1", "log.progress=false", "log.plots=false")
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert "loss.png" not in summary and not (tmp_path / "run" / "loss.png").exists()


@pytest.mark.parametrize("omp", [None, "2"])
def test_train_runs_on_one_thread_unless_omp_num_threads_says(monkeypatch, omp):
    """torch's default (a thread per core) collapses on a busy machine: `moe-plugin train` takes one thread per
    process, as torchrun does, unless OMP_NUM_THREADS is set."""
    from moe_plugin.train import command
    seen = []
    monkeypatch.setattr(command, "train", lambda cfg: seen.append(torch.get_num_threads()))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["train", "train.steps=1"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1 if omp is None else 2]


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path, fresh_seed):
    """train.compile (reduce-overhead: CUDA graphs on CUDA; on CPU a compiled step) trains as the eager loop does."""
    steps = ["train.steps=3", "train.eval_every=3", "train.checkpoint_every=0", f"train.seed={fresh_seed}"]
    _, eager = run(tmp_path, *TINY, *steps, name="eager")
    _, compiled = run(tmp_path, *TINY, *steps, "train.compile=reduce-overhead", name="compiled")
    losses = [(r["step"], r.get("loss")) for r in eager if "loss" in r]
    assert losses and all(abs(a[1] - b[1]) <= 1e-4 * abs(a[1])
                          for a, b in zip(losses, [(r["step"], r.get("loss")) for r in compiled if "loss" in r]))
    with pytest.raises(ValueError, match="train.compile"):
        train.load_config(None, ["train.compile=graphs"])
