"""The `lora` section of `moe-plugin train`: a tiny Mixtral run (configs/experiments/mixtral_tiny.yaml), then LoRA
on its experts from its checkpoint (everything else frozen); and a dense Llama run upcycled then fine-tuned with
LoRA. Reference: the run the LoRA run starts from (its last validation loss, its weights)."""

import pytest
import torch

from moe_plugin import checkpoint, train

import helpers.train
from helpers.hf import needs_transformers, transformers
from helpers.paths import REPO

ROOT = REPO
MIXTRAL_TINY = ROOT / "configs" / "experiments" / "mixtral_tiny.yaml"
DENSE = ROOT / "configs" / "experiments" / "llama_dense_tiny.yaml"
UPCYCLED = ROOT / "configs" / "experiments" / "llama_upcycled.yaml"
pytestmark = [needs_transformers, pytest.mark.timeout(300)]

TINY = ["hf.hidden_size=32", "hf.intermediate_size=40", "hf.num_attention_heads=2", "hf.num_key_value_heads=1",
        "model.seq_len=32", "train.batch_size=4", "train.eval_batches=2", "train.warmup_steps=2", "log.every=2",
        "log.progress=false", "log.plots=false"]


def run(config, out, *overrides):
    return helpers.train.run_in(out, *TINY, *overrides, config=config)


def last_state(out):
    step = sorted((out / "checkpoints").iterdir())[-1]
    return checkpoint.nest(checkpoint.full_state(step))["model"]


def test_lora_run_fine_tunes_the_experts_of_an_moe_run(tmp_path, fresh_seed):
    seeds = [f"data.seed={fresh_seed}", f"train.seed={fresh_seed}"]
    base, _ = run(MIXTRAL_TINY, tmp_path / "moe", "train.steps=8", "train.eval_every=8", "train.lr=0.01", *seeds)
    result, records = run(MIXTRAL_TINY, tmp_path / "lora", f"lora.checkpoint={tmp_path / 'moe'}", "lora.rank=4",
                          "lora.alpha=8", "train.steps=8", "train.eval_every=8", "train.lr=0.02", *seeds)
    # B starts at zero: step 0 computes what the MoE run ended with (from its checkpoint, or from its hf_model/)
    assert abs(result["val_loss_first"] - base["val_loss_last"]) < 1e-5, (result, base)
    from_hf, _ = run(MIXTRAL_TINY, tmp_path / "from_hf", f"lora.checkpoint={tmp_path / 'moe' / 'hf_model'}",
                     "train.steps=1", "train.eval_every=1", *seeds)
    assert abs(from_hf["val_loss_first"] - base["val_loss_last"]) < 1e-5, (from_hf, base)
    assert result["val_loss_last"] < result["val_loss_first"], result
    before, after = last_state(tmp_path / "moe"), last_state(tmp_path / "lora")
    adapters = [k for k in after if ".experts.lora." in k]
    assert len(adapters) == 2 * 4       # 2 layers x (up A, B, down A, B)
    assert set(after) - set(adapters) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before), "a frozen weight moved"
    assert all(after[k].abs().max() > 0 for k in adapters if k.endswith("_b_EQF") or k.endswith("_b_EQD"))
    # hf_model/: plain HF experts holding W + s A B, computing what the fine-tuned model computes
    from moe_plugin.train.hf_model import build_hf_model
    cfg = train.load_config(str(MIXTRAL_TINY), [*TINY, "lora.rank=4", "lora.alpha=8"])
    tuned = build_hf_model(cfg)
    tuned.load_state_dict(after)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "hf_model")
    ids = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, tuned(ids), rtol=1e-4, atol=1e-4)
    assert sum(p.numel() for p in tuned.parameters() if p.requires_grad) == \
        sum(after[k].numel() for k in adapters)


def test_lora_run_from_a_dense_run_upcycled(tmp_path, fresh_seed):
    seeds = [f"data.seed={fresh_seed}", f"train.seed={fresh_seed}"]
    dense, _ = run(DENSE, tmp_path / "dense", "train.steps=8", "train.eval_every=8", "train.lr=0.01", *seeds)
    result, _ = run(UPCYCLED, tmp_path / "lora", "upcycle.checkpoint=null", f"lora.checkpoint={tmp_path / 'dense'}",
                    "lora.rank=4", "train.steps=4", "train.eval_every=4", *seeds)
    assert abs(result["val_loss_first"] - dense["val_loss_last"]) < 1e-4, (result, dense)
    after = last_state(tmp_path / "lora")
    assert any(".experts.lora." in k for k in after)


@pytest.mark.parametrize("overrides, message", [
    (["lora.rnak=4"], "unknown key 'lora.rnak'"),
    (["lora.rank=0"], "lora.rank=0 is invalid"),
    (["lora.dropout=0.1"], "lora.dropout=0.1 is invalid"),
    (["lora.targets=[gate]"], "lora.targets=['gate'] is invalid"),
    (["lora.alpha=-1"], "lora.alpha=-1.0 is invalid"),
])
def test_lora_section_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        train.load_config(str(MIXTRAL_TINY), [*TINY, *overrides])


def test_lora_without_an_hf_section_is_an_error():
    with pytest.raises(ValueError, match="lora is invalid without an hf section"):
        train.load_config(None, ["lora.rank=4"])
