"""`moe-plugin plan --deepspeed ds.json --hf-config config.json` (integrations/deepspeed/plan.py): each rank's bytes
under ZeRO stages 0-3 against hand counts from the Hugging Face model's own parameters (built whole, unswapped),
the all-to-all bytes by hand, the JSON on stdout alone, and its errors (one line, exit code 2)."""
import json

import pytest
import torch

pytest.importorskip("deepspeed")
from moe_plugin import cli  # noqa: E402

from helpers.hf import needs_transformers, transformers  # noqa: E402

MIXTRAL = {"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 128}
MOE = {"backend": "tutel", "ep_size": 2, "num_experts": 4, "top_k": 2, "capacity_factor": 1.25, "drop_tokens": True}


def write(tmp_path, stage, bf16=True, moe=MOE):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    ds = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": bf16}, "zero_optimization": {"stage": stage},
          "moe": moe}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    return ["plan", "--deepspeed", str(tmp_path / "ds.json"), "--hf-config", str(tmp_path / "config.json"),
            "--seq-len", "64"]


def plan_json(capsys, arguments):
    assert cli.main([*arguments, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def hf_counts():
    """(dense, all experts') parameter counts of the HF model itself."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**{
            k: v for k, v in MIXTRAL.items() if k != "model_type"}))
    named = dict(model.named_parameters())
    experts = sum(p.numel() for name, p in named.items() if ".experts." in name)
    return sum(p.numel() for p in named.values()) - experts, experts


@needs_transformers
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_by_hand(tmp_path, capsys, stage):
    dense, experts = hf_counts()            # 4 ranks; ep 2: 2 experts per rank, each held by 2 ranks
    local = experts // 2
    role = plan_json(capsys, [*write(tmp_path, stage), "--world-size", "4"])["roles"][0]
    bf16 = 2 * dense, 2 * local
    assert role["ranks"] == [0, 1, 2, 3]
    assert role["parameters_bytes"] == (bf16[0] // 4 + bf16[1] // 2 if stage == 3 else sum(bf16))
    assert role["gradients_bytes"] == (bf16[0] // 4 + bf16[1] // 2 if stage >= 2 else sum(bf16))
    adam = 12 * dense, 12 * local           # fp32 master, exp_avg, exp_avg_sq
    assert role["optimizer_bytes"] == (adam[0] // 4 + adam[1] // 2 if stage >= 1 else sum(adam))
    # 2 rows x 64 tokens x top-2 = 256 rows of 64 bf16 values per pass; 4 passes; 2 MoE layers
    assert role["all_to_all_bytes"] == 2 * 4 * 256 * 64 * 2


@needs_transformers
def test_fp32_adam_keeps_no_master_copy(tmp_path, capsys):
    dense, experts = hf_counts()
    role = plan_json(capsys, [*write(tmp_path, 1, bf16=False), "--world-size", "4"])["roles"][0]
    assert role["parameters_bytes"] == 4 * (dense + experts // 2)
    assert role["optimizer_bytes"] == 8 * dense // 4 + 8 * (experts // 2) // 2


@needs_transformers
@pytest.mark.parametrize("change, extra, message", [
    ({}, ["--world-size", "3"], "DeepSpeed config \"moe.ep_size\"=2 is invalid: must divide the number of processes"),
    ({"moe": {**MOE, "ep_size": 3}}, ["--world-size", "3"], "\"moe.ep_size\"=3 is invalid for the mixtral model's 4"),
    ({"moe": {**MOE, "num_experts": 8}}, ["--world-size", "4"], "\"moe.num_experts\"=8 contradicts"),
    ({}, ["--world-size", "4", "moe.top_k=1"], "--deepspeed plans a DeepSpeed run: leave out the experiment"),
])
def test_errors_are_one_line(tmp_path, capsys, change, extra, message):
    arguments = write(tmp_path, 1, moe=change.get("moe", MOE))
    assert cli.main([*arguments, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_missing_flags_are_named(tmp_path, capsys):
    assert cli.main(["plan", "--world-size", "2", "--deepspeed", "ds.json", "--seq-len", "8"]) == 2
    assert "--deepspeed needs --hf-config" in capsys.readouterr().err
