"""`moe-plugin train` with parallel.fsdp=true (FSDP2) against the DDP mode, on 2 and 4 gloo processes.

The losses of every step equal DDP's at ep_size 1 and 2, in fp64 to 1e-12 (in fp32 the modes' summation orders
once flipped a near-tied routing choice, seed 1227821324 in CI, and the losses parted; 30 other seeds did not), and a
checkpoint of either mode resumes in the other with another ep_size and continues the other's run. Across process counts,
every restored tensor must equal this rank's share of the saving run's whole state, bit for bit (the
reference is gathered by the saving run, as in test_checkpoint_reshard.py).
What this module tests (moved here from the README):

`tests/train/test_train_fsdp.py` (train: per-step losses and val loss equal DDP's on 2 and 4
processes at ep_size 1 and 2; resume FSDP2 <-> DDP with another ep_size continues the other run; every
restored tensor bit-exact after resuming on another number of processes; meta build = plain build);
"""
import json
import os

import pytest
import torch

from moe_plugin import train

from helpers.hf import needs_transformers, transformers
from helpers.launch import run_workers
from helpers.paths import REPO
from helpers.reshard import restore_and_compare, train_and_save

TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=16", "model.ffn_hidden=48",
        "moe.hidden_size=24", "moe.num_experts=4", "train.batch_size=3", "train.eval_batches=1",
        "train.warmup_steps=2", "train.steps=6", "train.eval_every=6", "train.checkpoint_every=3",
        "train.lr=0.01", "log.every=1", "log.progress=false", "log.plots=false"]


def _runs(rank, world, out, seed, runs):
    """Each run of `runs` (name -> overrides; a resume names the run it resumes) as torchrun would start it."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_default_dtype(torch.float64)
    for name, overrides in runs.items():
        overrides = [o.format(out=out) for o in overrides]
        train.train(train.load_config(None, [*TINY, *overrides, f"log.out_dir={out}/{name}",
                                             f"train.seed={seed}", f"data.seed={seed}"]))


def records(out, name):
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def losses(out, name, key="loss"):
    return {r["step"]: r[key] for r in records(out, name) if key in r}


RUNS = {
    "ddp ep1": [], "fsdp ep1": ["parallel.fsdp=true"],
    "ddp ep2": ["parallel.ep_size=2"], "fsdp ep2": ["parallel.ep_size=2", "parallel.fsdp=true"],
    # resumed at step 3 from the other mode, with the other ep_size
    "fsdp ep2 from ddp ep1": ["parallel.ep_size=2", "parallel.fsdp=true",
                              "train.resume={out}/ddp ep1/checkpoints/step_000003"],
    "ddp ep1 from fsdp ep2": ["train.resume={out}/fsdp ep2/checkpoints/step_000003"],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_training_equals_ddp_and_resumes_across_modes(tmp_path, world, fresh_seed):
    runs = RUNS if world == 2 else {k: v for k, v in RUNS.items() if "from" not in k}
    run_workers(_runs, world, str(tmp_path), fresh_seed, runs, timeout=400)
    ddp = losses(tmp_path, "ddp ep1")
    assert sorted(ddp) == [1, 2, 3, 4, 5, 6] and ddp[6] < ddp[1]
    for name in runs:
        got = losses(tmp_path, name)
        assert sorted(got) == ([4, 5, 6] if "from" in name else [1, 2, 3, 4, 5, 6]), name
        for step, loss in got.items():
            assert loss == pytest.approx(ddp[step], rel=1e-12), (name, step)
        assert losses(tmp_path, name, "val_loss")[6] == pytest.approx(losses(tmp_path, "ddp ep1", "val_loss")[6],
                                                                        rel=1e-12), name
    result = json.loads((tmp_path / "fsdp ep2" / "result.json").read_text())
    shared = result["shared_param_sha256_per_rank"]
    assert len(set(shared)) == 1 and len(set(result["param_sha256_per_rank"])) == 2   # 2 ranks' experts


SWIGLU = ["moe.num_experts=2", "moe.top_k=1", "moe.activation=swiglu", "moe.bias=true"]
MOVES = {  # FSDP2 with 1 expert per rank on 2 ranks holding it: w1, w2 sharded on D, biases on E (one shard empty)
    "2 processes fsdp ep 2 -> 4 processes fsdp ep 2": ((2, ["parallel.ep_size=2", "parallel.fsdp=true"]),
                                                       (4, ["parallel.ep_size=2", "parallel.fsdp=true"])),
    "4 processes fsdp ep 2 -> 1 process": ((4, ["parallel.ep_size=2", "parallel.fsdp=true"]), (1, [])),
}


@pytest.mark.slow
@pytest.mark.parametrize("move", list(MOVES))
def test_fsdp_checkpoint_resumes_on_another_number_of_processes(tmp_path, fresh_seed, move):
    (src_world, src), (dst_world, dst) = MOVES[move]
    seed = [f"train.seed={fresh_seed}", f"data.seed={fresh_seed}", *SWIGLU]
    run_workers(train_and_save, src_world, [*src, *seed], str(tmp_path), 3, timeout=200)
    path, reference = tmp_path / "checkpoints" / "step_000003", tmp_path / "reference.pt"
    results = run_workers(restore_and_compare, dst_world, [*dst, *seed], str(path), str(reference), timeout=200)
    full = torch.load(reference, weights_only=True)
    for rank, result in enumerate(results):
        assert result["errors"] == [] and result["step"] == 3 and result["lr"] == full["lr"], (rank, result)
        assert result["data_ok"] and result["window_steps"] == 0 and result["checked"] > 10
        assert result["experts_here"] == (1 if dst_world > 1 else 0)


@pytest.mark.parametrize("extra", [[], ["moe.shared_hidden_size=16", "moe.router=cosine", "moe.activation=swiglu",
                                        "moe.bias=true", "model.tie_embeddings=false"]])
def test_fsdp_mode_builds_on_meta_the_weights_of_a_plain_construction(extra, fresh_seed):
    """parallel.fsdp builds the model on the meta device (then to_empty and reset_parameters): every parameter and
    buffer equals the plain construction's from the same seed."""
    from moe_plugin.train.data import VOCAB_SIZE
    from moe_plugin.train.models import TransformerLM
    from moe_plugin.train.parts import materialize_from_meta
    cfg = train.load_config(None, [*TINY, *extra])
    torch.manual_seed(fresh_seed)
    plain = TransformerLM(cfg.model, train.moe_config(cfg), VOCAB_SIZE)
    torch.manual_seed(fresh_seed)
    built = materialize_from_meta(lambda: TransformerLM(cfg.model, train.moe_config(cfg), VOCAB_SIZE),
                                  torch.device("cpu"))
    state = built.state_dict()
    assert all(not t.is_meta for t in state.values())
    assert [k for k, v in plain.state_dict().items() if not torch.equal(v, state[k])] == []


def _hf_run(rank, world, out, seed):
    from moe_plugin.train.command import main   # noqa: F401  (the command's imports, as torchrun runs it)
    import moe_plugin.integrations.transformers  # noqa: F401  hides an unloadable torchaudio first
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    root = REPO
    train.train(train.load_config(str(root / "configs" / "experiments" / "mixtral_tiny.yaml"), [*HF_TINY,
                f"log.out_dir={out}", f"train.seed={seed}", "parallel.ep_size=2", "parallel.fsdp=true"]))


HF_TINY = ["hf.hidden_size=32", "hf.intermediate_size=40", "hf.num_attention_heads=2", "hf.num_key_value_heads=1",
           "model.seq_len=32", "train.batch_size=4", "train.eval_batches=2", "train.warmup_steps=2",
           "train.steps=4", "train.eval_every=4", "log.progress=false", "log.plots=false"]


@pytest.mark.slow
@needs_transformers
def test_fsdp_training_of_an_hf_architecture_exports_a_folder_plain_transformers_loads(tmp_path, fresh_seed):
    from moe_plugin import checkpoint
    from moe_plugin.train.data import make_data
    from moe_plugin.train.hf_model import build_hf_model
    out = tmp_path / "hf"
    run_workers(_hf_run, 2, str(out), fresh_seed, timeout=300)
    result = json.loads((out / "result.json").read_text())
    root = REPO
    cfg = train.load_config(str(root / "configs" / "experiments" / "mixtral_tiny.yaml"), HF_TINY)
    model = build_hf_model(cfg)   # one process, every expert: the checkpoint's model
    model.load_state_dict(checkpoint.nest(checkpoint.full_state(out / "checkpoints" / "step_000004"))["model"])
    data = make_data(cfg.data, cfg.train.batch_size, cfg.model.seq_len, cfg.train.eval_batches)
    assert train.evaluate(model, data.val, torch.device("cpu")) == pytest.approx(result["val_loss_last"], rel=1e-5)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "hf_model")
    x_BS = data.val[0][0]
    with torch.no_grad():
        want, got = model(x_BS), plain(input_ids=x_BS).logits
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
