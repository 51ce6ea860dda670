"""`moe-plugin plan --deepspeed ds.json --hf-config config.json` (integrations/deepspeed/plan.py): each rank's bytes
under ZeRO stages 0-3 against hand counts from the Hugging Face model's own parameters (built whole, unswapped), the
parameter and optimizer bytes against a real 2-rank DeepSpeed run (ZeRO 1 fp32, ZeRO 2 bf16, ZeRO 1 with SGD,
stage 0 fp32, ZeRO 3 bf16), the all-to-all bytes
by hand, the JSON on stdout alone, and its errors (one line, exit code 2)."""
import json
import logging
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
from moe_plugin import cli  # noqa: E402

from helpers.hf import needs_transformers, transformers  # noqa: E402
from helpers.launch import run_workers  # noqa: E402

MIXTRAL = {"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 128}
MOE = {"backend": "tutel", "ep_size": 2, "num_experts": 4, "top_k": 2, "capacity_factor": 1.25, "drop_tokens": True}


def write(tmp_path, stage, bf16=True, moe=MOE, optimizer=None):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    ds = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "bf16": {"enabled": bf16},
          "zero_optimization": {"stage": stage},
          "moe": moe, **({"optimizer": optimizer} if optimizer else {})}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    return ["plan", "--deepspeed", str(tmp_path / "ds.json"), "--hf-config", str(tmp_path / "config.json"),
            "--seq-len", "64"]


def plan_json(capsys, arguments):
    assert cli.main([*arguments, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


TENSORS = 21     # the Mixtral's parameter tensors: 9 in each of 2 layers (attention 4, norms 2, router, 2 stacked
                 # expert projections), the embedding, the final norm and the head


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
    adam = 12 * dense, 12 * local           # fp32 copy, exp_avg, exp_avg_sq
    # a 4-byte step for each of ZeRO's 2 groups; stage 0 (torch's Adam): for each parameter tensor
    assert role["optimizer_bytes"] == (adam[0] // 4 + adam[1] // 2 + 8 if stage >= 1 else sum(adam) + 4 * TENSORS)
    # 2 rows x 64 tokens x top-2 = 256 rows of 64 bf16 values per pass; 4 passes; 2 MoE layers
    assert role["all_to_all_bytes"] == 2 * 4 * 256 * 64 * 2


@needs_transformers
@pytest.mark.parametrize("stage, copy", [(0, 0), (1, 4)])
def test_fp32_weights_keep_an_fp32_copy_under_zero_only(tmp_path, capsys, stage, copy):
    dense, experts = hf_counts()
    role = plan_json(capsys, [*write(tmp_path, stage, bf16=False), "--world-size", "4"])["roles"][0]
    local = experts // 2
    assert role["parameters_bytes"] == 4 * (dense + local)
    per = 8 + copy
    assert role["optimizer_bytes"] == (per * dense // 4 + per * local // 2 + 8 if stage else
                                       per * (dense + local) + 4 * TENSORS)


def _real_steps(rank, world, ds_paths):
    """Per DeepSpeed config, one step of DeepSpeed's engine (moe_plugin's initialize): what the rank holds."""
    import moe_plugin.integrations.transformers  # noqa: F401  (before transformers: hides an unloadable torchaudio)
    import deepspeed
    from moe_plugin.integrations.deepspeed import initialize
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    nbytes = lambda t: t.numel() * t.element_size()   # noqa: E731
    held = []
    for ds_path in ds_paths:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **{k: v for k, v in MIXTRAL.items() if k != "model_type"}))
        config = {**json.loads(Path(ds_path).read_text()), "zero_allow_untested_optimizer": True}   # SGD
        engine = initialize(model=model, config=config)[0]
        ids = torch.randint(0, MIXTRAL["vocab_size"], (2, 64))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)     # ZeRO's wraps torch's
        state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        copies = list(getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or
                      getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))
        held.append({"parameters": sum(nbytes(getattr(p, "ds_tensor", p)) for p in engine.module.parameters()),
                     "optimizer": sum(nbytes(t) for t in state + copies)})
    return held


@needs_transformers
@pytest.mark.slow
def test_parameter_and_optimizer_bytes_equal_a_real_deepspeed_run(tmp_path, capsys):
    planned, paths = [], []
    adam = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
    sgd = {"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}}
    # ZeRO 1 in fp32, ZeRO 2 in bf16 (Adam), ZeRO 1 in bf16 with SGD's momentum (one buffer, no step)
    for i, (stage, bf16, optimizer) in enumerate(((1, False, adam), (2, True, adam), (1, True, sgd),
                                                  (0, False, adam), (3, True, adam))):
        (tmp_path / str(i)).mkdir()
        planned.append(plan_json(capsys, [*write(tmp_path / str(i), stage, bf16=bf16, optimizer=optimizer),
                                          "--world-size", "2"]))
        paths.append(str(tmp_path / str(i) / "ds.json"))
    assert planned[2]["roles"][0]["optimizer_bytes"] < planned[1]["roles"][0]["optimizer_bytes"]
    for rank, held in enumerate(run_workers(_real_steps, 2, paths, timeout=300)):
        for plan, real in zip(planned, held):
            role = plan["roles"][0]
            assert (real["parameters"], real["optimizer"]) == (role["parameters_bytes"], role["optimizer_bytes"]), \
                rank


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


@needs_transformers
def test_an_optimizer_it_cannot_plan_is_named(tmp_path, capsys):
    assert cli.main([*write(tmp_path, 1, optimizer={"type": "Muon", "params": {}}), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "DeepSpeed config \"optimizer.type\"='Muon' is not planned: allowed: Adam, AdamW" in err, err
    assert err.count("\n") == 1


def test_missing_flags_are_named(capsys):
    assert cli.main(["plan", "--world-size", "2", "--deepspeed", "ds.json", "--seq-len", "8"]) == 2
    assert "--deepspeed needs --hf-config" in capsys.readouterr().err
