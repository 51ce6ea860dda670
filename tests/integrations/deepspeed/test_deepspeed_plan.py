"""`moe-plugin plan --deepspeed ds.json --hf-config config.json` (integrations/deepspeed/plan.py): each rank's bytes
under ZeRO stages 0-3 against hand counts from the Hugging Face model's own parameters (built whole, unswapped), the
all-to-all bytes by hand; against real DeepSpeed runs on 2 ranks (stage 0 and ZeRO 1 fp32, ZeRO 1 bf16 with SGD,
ZeRO 2 and 3 bf16, ZeRO 1 fp32 with every row kept) and 4 (ZeRO 2 and 3 bf16) the parameter, gradient, optimizer and all-to-all bytes exactly and
the activations within 10%; the JSON on stdout alone, and its errors (one line, exit code 2)."""
import contextlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
from moe_plugin import cli  # noqa: E402
from moe_plugin.plan.state_bytes import nbytes, saved_for_backward, storage_key  # noqa: E402

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


FULL, KEPT = 0.1, 2.0   # "moe.capacity_factor": every expert full; every row kept (see the real-run test)
ADAM = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
SGD = {"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}}
# the DeepSpeed configs each real rank runs in turn, by world size: (ZeRO stage, bf16, optimizer, capacity_factor)
RUNS = {2: [(1, False, ADAM, FULL), (2, True, ADAM, KEPT), (1, True, SGD, FULL), (0, False, ADAM, FULL),
            (3, True, ADAM, KEPT), (1, False, ADAM, KEPT)],
        4: [(2, True, ADAM, FULL), (3, True, ADAM, KEPT)]}


@contextlib.contextmanager
def _saved_under_zero3(model, total):
    """saved_for_backward's count (each storage once, the parameters not) where ZeRO-3 gathers each module's
    parameters for its forward: autograd keeps the Parameter object itself, whose gathered data ZeRO-3 frees after
    the module and gathers again for backward, so a saved parameter is left out by identity (its storage at the
    start is the empty partitioned one)."""
    params = {id(p) for p in model.parameters()}
    seen, held = set(), []          # held: no storage freed and its key reused while counting
    total.setdefault("bytes", 0)

    def pack(tensor):
        if id(tensor) not in params and storage_key(tensor) not in seen:
            seen.add(storage_key(tensor))
            held.append(tensor)
            total["bytes"] += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def _gradient_bytes(engine, at_reduction):
    """The gradient bytes the rank holds, in DeepSpeed's own structures (see the real-run test)."""
    stage, optimizer = engine.zero_optimization_stage(), engine.optimizer
    if stage == 0:
        return sum(nbytes(p.grad) for p in engine.module.parameters() if p.grad is not None)
    if stage == 1:
        return at_reduction["bytes"]
    if stage == 2:
        return sum(nbytes(t) for group in optimizer.averaged_gradients.values() for t in group)
    return nbytes(optimizer.grad_partitions_flat_buffer)


def _real_steps(rank, world, ds_paths, seed):
    """Per DeepSpeed config, one step of DeepSpeed's engine (moe_plugin's initialize) on this rank's 2 x 64 tokens:
    what the rank holds, hands to all_to_all_single and saves for backward."""
    import moe_plugin.integrations.transformers  # noqa: F401  (before transformers: hides an unloadable torchaudio)
    import deepspeed
    import torch.distributed as dist
    from moe_plugin import MoELayer
    from moe_plugin.integrations.deepspeed import initialize
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    held = []
    for ds_path in ds_paths:
        torch.manual_seed(seed + rank)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **{k: v for k, v in MIXTRAL.items() if k != "model_type"}))
        config = {**json.loads(Path(ds_path).read_text()), "zero_allow_untested_optimizer": True}   # SGD
        engine = initialize(model=model, config=config)[0]
        stage, optimizer = engine.zero_optimization_stage(), engine.optimizer
        moved, at_reduction, saved = {"sent": 0, "received": 0}, {}, {}

        def counting(output, input, *args, **kwargs):
            moved["sent"] += nbytes(input)
            moved["received"] += nbytes(output)
            return exchange(output, input, *args, **kwargs)

        def reduce_gradients(*args, **kwargs):      # ZeRO 1: every full gradient, as backward hands them over
            at_reduction["bytes"] = sum(nbytes(p.grad) for group in optimizer.bit16_groups for p in group
                                        if p.grad is not None)
            return reduce(*args, **kwargs)

        exchange, dist.all_to_all_single = dist.all_to_all_single, counting
        if stage == 1:
            reduce, optimizer.reduce_gradients = optimizer.reduce_gradients, reduce_gradients
        try:
            ids = torch.randint(0, MIXTRAL["vocab_size"], (2, 64))
            with (saved_for_backward if stage < 3 else _saved_under_zero3)(engine.module, saved):
                loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            gradients = _gradient_bytes(engine, at_reduction)
            engine.step()
        finally:
            dist.all_to_all_single = exchange
        inner = getattr(optimizer, "optimizer", optimizer)     # ZeRO's wraps torch's
        state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        copies = list(getattr(optimizer, "single_partition_of_fp32_groups", None) or
                      getattr(optimizer, "fp32_partitioned_groups_flat", []))
        layers = [m.stats for m in engine.module.modules() if isinstance(m, MoELayer)]
        held.append({"parameters": sum(nbytes(getattr(p, "ds_tensor", p)) for p in engine.module.parameters()),
                     "gradients": gradients, "optimizer": sum(nbytes(t) for t in state + copies),
                     "activations": saved["bytes"], "capacity_used": [s["capacity_used"] for s in layers],
                     "dropped": [s["dropped_fraction"] for s in layers], **moved})
    return held


@needs_transformers
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_plan_equals_a_real_deepspeed_run(tmp_path, capsys, fresh_seed, world):
    """Each rank of a real DeepSpeed run (2 x 64 tokens, ep_size 2) against the plan of the same config.

    Exactly: the parameters (ZeRO 3: each parameter's ds_tensor partition), the optimizer state (torch's state and
    ZeRO's fp32 partitions) and the gradients where DeepSpeed keeps them: stage 0, every p.grad after backward;
    ZeRO 1, every p.grad as backward hands them to the ZeRO optimizer's reduce_gradients (it then keeps its own
    partition only); ZeRO 2, the rank's partition (the optimizer's averaged_gradients) after backward; ZeRO 3,
    its grad_partitions_flat_buffer. The all-to-all bytes: at capacity_factor 0.1 (7 slots per expert, all
    filled: the worker checks it) what each rank handed to all_to_all_single and got back, exactly; at 2.0 (128
    slots: a token picks an expert once, so none of its 128 tokens can be dropped) routing moves bytes between
    ranks, and what all ranks sent and received together is exactly world x the plan's balanced figure. Within
    10% at 2.0: the plan's activations against the bytes the real forward and HF's loss saved for backward
    (saved_for_backward; ZeRO 3's gathered parameters left out, _saved_under_zero3)."""
    planned, paths = [], []
    for i, (stage, bf16, optimizer, cf) in enumerate(RUNS[world]):
        (tmp_path / str(i)).mkdir()
        planned.append(plan_json(capsys, [*write(tmp_path / str(i), stage, bf16=bf16, optimizer=optimizer,
                                                 moe={**MOE, "capacity_factor": cf}), "--world-size", str(world)]))
        paths.append(str(tmp_path / str(i) / "ds.json"))
    if world == 2:      # SGD's one momentum buffer against Adam's two moments
        assert planned[2]["roles"][0]["optimizer_bytes"] < planned[1]["roles"][0]["optimizer_bytes"]
    real = run_workers(_real_steps, world, paths, fresh_seed, timeout=300)
    for run, (plan, (stage, bf16, _, cf)) in enumerate(zip(planned, RUNS[world])):
        role, layers = plan["roles"][0], len(plan["moe_layers"])
        assert role["ranks"] == list(range(world))
        if cf == KEPT:
            assert sum(step[run]["sent"] for step in real) == sum(step[run]["received"] for step in real) == \
                world * role["all_to_all_bytes"], (world, stage, [step[run]["sent"] for step in real])
        for rank, held in enumerate(step[run] for step in real):
            where = f"world {world}, ZeRO {stage}, bf16 {bf16}, capacity_factor {cf}: rank {rank}"
            assert {k: held[k] for k in ("parameters", "gradients", "optimizer")} == {
                k: role[f"{k}_bytes"] for k in ("parameters", "gradients", "optimizer")}, where
            if cf == FULL:
                assert held["capacity_used"] == [1.0] * layers, where       # the count's precondition
                assert held["sent"] == held["received"] == role["all_to_all_bytes"], where
            else:
                assert held["dropped"] == [0.0] * layers, where
                assert abs(role["activations_bytes"] - held["activations"]) <= 0.10 * held["activations"], \
                    (where, role["activations_bytes"], held["activations"])


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
