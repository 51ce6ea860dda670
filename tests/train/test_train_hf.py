"""`moe-plugin train` on a Hugging Face MoE architecture (configs/experiments/mixtral_tiny.yaml)."""

import pytest
import torch

from moe_plugin import MoELayer, checkpoint, train
import helpers.train
from helpers.hf import hf_moe, needs_transformers, transformers
from helpers.launch import torchrun_train
from helpers.paths import REPO

ROOT = REPO
MIXTRAL_TINY = ROOT / "configs" / "experiments" / "mixtral_tiny.yaml"
pytestmark = [needs_transformers, pytest.mark.timeout(300)]

TINY = ["hf.hidden_size=32", "hf.intermediate_size=40", "hf.num_attention_heads=2", "hf.num_key_value_heads=1",
        "model.seq_len=32", "train.batch_size=4", "train.eval_batches=2", "train.warmup_steps=2",
        "log.progress=false"]


def run(tmp_path, *overrides, name="run"):
    return helpers.train.run(tmp_path, *TINY, *overrides, name=name, config=MIXTRAL_TINY)


def test_mixtral_tiny_learns_and_writes_the_usual_outputs(tmp_path, fresh_seed):
    result, records = run(tmp_path, "train.steps=20", "train.eval_every=10", "log.every=5", "train.lr=0.01",
                          f"train.seed={fresh_seed}", f"data.seed={fresh_seed}")
    out = tmp_path / "run"
    for name in ("metrics.jsonl", "loss.png", "expert_load.png", "summary.txt", "result.json", "config.yaml",
                 "checkpoints/step_000020"):
        assert (out / name).exists(), name
    assert result["val_loss_last"] < result["val_loss_first"] - 0.5
    last = [r for r in records if "tokens_per_expert" in r][-1]
    assert len(last["tokens_per_expert"]) == 2 and all(len(load) == 8 for load in last["tokens_per_expert"])
    assert sum(last["tokens_per_expert"][0]) == 5 * 4 * 32 * 2       # 5 steps of 4 x 32 tokens, top-2
    assert last["dropped_fraction"] == 0.0 and last["aux_loss"] > 0   # dropless; switch balance loss
    assert "model_type: mixtral" in (out / "config.yaml").read_text()
    assert "hf_model/" in (out / "summary.txt").read_text()
    state = checkpoint.nest(checkpoint.full_state(out / "checkpoints" / "step_000020"))["model"]
    assert state["hf.model.layers.1.mlp.moe.experts.w1_EDH"].shape == (8, 32, 80)
    # hf_model/: the trained model for plain transformers, computing what the run's checkpoint computes
    from moe_plugin.train.hf_model import build_hf_model
    cfg = train.load_config(str(MIXTRAL_TINY), TINY)
    trained = build_hf_model(cfg)
    trained.load_state_dict(state)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "hf_model")
    assert not any(isinstance(m, hf_moe.HFMoEBlock) for m in plain.modules())
    ids = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        expected = trained(ids)
        assert (plain(input_ids=ids).logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_the_model_is_the_hf_architecture_on_the_layer(fresh_seed):
    """Built by the trainer: a transformers MixtralForCausalLM whose blocks are swapped, computing what
    the unswapped model built from the same config and seed computes."""
    from moe_plugin.train.hf_model import build_hf_model, hf_config
    cfg = train.load_config(str(MIXTRAL_TINY), TINY)
    torch.manual_seed(fresh_seed)
    model = build_hf_model(cfg)
    torch.manual_seed(fresh_seed)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config(cfg))
    assert type(model.hf) is transformers.MixtralForCausalLM and model.hf.config.vocab_size == 256
    assert len(model.moe_layers()) == 2 and all(isinstance(m, MoELayer) for m in model.moe_layers())
    assert model.moe_layers()[0].config.capacity_factor == 0.0 and model.moe_layers()[0].config.aux_loss == "switch"
    x = torch.randint(0, 256, (3, 32))
    with torch.no_grad():
        expected, actual = reference(x).logits, model(x)
    assert float((actual - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


def test_moe_section_applies_on_top_of_the_hf_config(tmp_path, fresh_seed):
    _, records = run(tmp_path, "train.steps=4", "train.eval_every=4", "log.every=2", "moe.capacity_factor=0.5",
                     "moe.min_capacity=1", "log.plots=false", f"train.seed={fresh_seed}")
    assert all(r["dropped_fraction"] > 0 for r in records if "dropped_fraction" in r)


def test_resume_continues_bit_exactly(tmp_path, fresh_seed):
    common = ["train.steps=8", "train.eval_every=4", "train.checkpoint_every=4", "log.every=1", "log.plots=false",
              f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    full, full_records = run(tmp_path, *common, name="full")
    run(tmp_path, *common, "train.stop_at=4", name="split")
    resumed, split_records = run(tmp_path, *common, "train.resume=latest", name="split")
    for key in ("loss", "aux_loss", "val_loss", "tokens_per_expert"):
        assert [r.get(key) for r in split_records] == [r.get(key) for r in full_records], key
    assert resumed["param_sha256_per_rank"] == full["param_sha256_per_rank"]


@pytest.mark.parametrize("override, expected", [
    ("hf.model_type=vit", r"hf.model_type='vit' is invalid: must be a Hugging Face MoE family \(.*mixtral.*\) or a "
                          r"dense causal LM type"),
    ("hf.vocab_size=1000", r"hf.vocab_size=1000 is invalid: the data are bytes, so it must be 256"),
    ("hf.max_position_embeddings=16", r"hf.max_position_embeddings=16 is invalid: must be >= model.seq_len=32"),
    ("moe.top_k=3", r"moe.top_k=3 contradicts the hf section \(mixtral gives top_k=2\)"),
    ("moe.capacity_factr=1", r"no field 'capacity_factr'"),
    ("parallel.ep_size=3", r"parallel.ep_size=3 is invalid"),
])
def test_bad_hf_configs_name_the_key(override, expected):
    with pytest.raises(ValueError, match=expected):
        train.load_config(str(MIXTRAL_TINY), [*TINY, override])


def test_print_config_shows_the_moe_section_the_hf_config_gives(capsys):
    from moe_plugin.cli import main
    assert main(["train", str(MIXTRAL_TINY), *TINY, "hf.num_local_experts=5", "hf.num_experts_per_tok=3",
                 "--print-config"]) == 0
    moe = capsys.readouterr().out.split("moe:\n")[1].split("\ndata:")[0]
    for line in ("num_experts: 5", "top_k: 3", "hidden_size: 40", "activation: swiglu", "capacity_factor: 0.0"):
        assert f"  {line}" in moe.splitlines(), f"{line!r} not in the printed moe section:\n{moe}"


@pytest.mark.timeout(300)
def test_two_processes_expert_parallel(tmp_path, fresh_seed):
    out = tmp_path / "ep"
    result, _ = torchrun_train(out, str(MIXTRAL_TINY), *TINY, "parallel.ep_size=2", "train.steps=8",
                               "train.eval_every=4", "log.every=2", "log.plots=false", f"train.seed={fresh_seed}",
                               timeout=240)
    shared, everything = result["shared_param_sha256_per_rank"], result["param_sha256_per_rank"]
    assert shared[0] == shared[1] and everything[0] != everything[1]   # each rank holds its own experts
    # the checkpoint holds every expert: one process loads it and gets the run's last validation loss
    state = checkpoint.nest(checkpoint.full_state(out / "checkpoints" / "step_000008"))["model"]
    assert state["hf.model.layers.0.mlp.moe.experts.w1_EDH"].shape[0] == 8
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "hf_model")   # every expert, gathered
    assert plain.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
    from moe_plugin.train.data import make_data
    from moe_plugin.train.hf_model import build_hf_model
    cfg = train.load_config(str(MIXTRAL_TINY), TINY)
    model = build_hf_model(cfg)
    model.load_state_dict(state)
    data = make_data(cfg.data, cfg.train.batch_size, cfg.model.seq_len, cfg.train.eval_batches)
    assert train.evaluate(model, data.val, torch.device("cpu")) == pytest.approx(result["val_loss_last"], rel=1e-5)
