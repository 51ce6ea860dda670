"""Pipeline MoE checkpoints across layouts: examples/deepspeed/pipeline_moe.py's PipelineModule (2 MoE blocks, dropless
top-2 of 4 experts, Adam eps 1e-6, WarmupLR, fp32) trains 3 steps at 2 stages x 2 data-parallel ranks, ep_size 2
(ZeRO 1 and ZeRO 0) and saves; its uninterrupted next 2 steps on the same global batches are the reference. Plain
engine.load_checkpoint(dir) then loads it at 2 stages x 1 (ep_size 1, also ZeRO 1 -> 0), at 1 stage x 2 (ep_size 2
and 1) and in the saved layout: the next 2 losses within rel 1e-4 of the reference (the same layout: equal), the step
counters and lr as saved, and every parameter's exp_avg, exp_avg_sq (and ZeRO-1 fp32 master) gathered whole
bit-equal to the saved run's. A pipeline checkpoint without its stages' records (saved before this conversion)
stops with one line naming both layouts and why; this_stage's other refusals (bf16, a PipelineModule on one side
only, a saved stage without an MoE layer) are checked without processes.

Every global batch is 4 micro-batches of 4 sequences: data-parallel rank d of D takes micro-batches 4d/D .. 4(d+1)/D
(gradient accumulation 4/D), so each layout's step sees the same sequences in the same micro-batches.
"""
import os
import shutil

import pytest
import torch

pytest.importorskip("deepspeed")
from helpers.launch import run_workers  # noqa: E402
from helpers.paths import load_script  # noqa: E402

SECTION = {"backend": "tutel", "num_experts": 4, "top_k": 2, "drop_tokens": False}
MICRO, MICROS, STEPS = 4, 4, 3
SAVED = (1, 0)                                  # ZeRO stages saved at 2 stages x 2 ranks, ep_size 2
# (saved ZeRO stage, (pipeline stages, ZeRO stage, ep_size)) loaded on 2 processes
LOADS = ((1, (2, 1, 1)), (0, (2, 0, 1)), (1, (2, 0, 1)), (1, (1, 1, 2)), (1, (1, 1, 1)), (0, (1, 0, 2)),
         (1, (4, 1, 1)))


def _engine(stages, zero, ep_size):
    from deepspeed.pipe import LayerSpec, PipelineModule
    example = load_script("examples/deepspeed/pipeline_moe.py")
    from moe_plugin.integrations.deepspeed import initialize
    dp = torch.distributed.get_world_size() // stages
    section = {**SECTION, "ep_size": ep_size}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICROS // dp,
              "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "eps": 1e-6, "torch_adam": True,
                                                       "weight_decay": 0.0}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10}},
              "zero_optimization": {"stage": zero}, "moe": section}
    torch.manual_seed(0)
    model = PipelineModule([LayerSpec(cls, *args) for cls, args in example.layers(section, blocks=4)],
                           num_stages=stages, loss_fn=example.lm_loss, partition_method="type:MoEBlock")
    engine = initialize(model=model, config=config, model_parameters=model.parameters())[0]
    assert len([m for m in model.modules() if isinstance(m, example.MoEBlock)]) == 4 // stages
    return engine


def _step(engine, step):
    """train_batch on this data-parallel rank's micro-batches of the step's global batch; the loss averaged over
    the global batch (the same on every rank)."""
    example = load_script("examples/deepspeed/pipeline_moe.py")
    per_rank = MICROS // engine.grid.get_data_parallel_world_size()
    first = engine.grid.get_data_parallel_rank() * per_rank
    micros = [example.batch(torch.Generator().manual_seed(1000 * step + m), MICRO)
              for m in range(first, first + per_rank)]
    return engine.train_batch(iter(micros)).item()


def _whole(param, tensor):
    """An expert tensor's local experts with the other ranks' of its expert-parallel group (in rank order)."""
    from deepspeed.utils import groups
    if getattr(param, "allreduce", True) is False:
        group = groups._get_expert_parallel_group(param.group_name)
        if torch.distributed.get_world_size(group) > 1:
            parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
            return torch.cat(parts)
    return tensor


def _moments(engine):
    """This stage's parameters' exp_avg, exp_avg_sq (and ZeRO-1 fp32 master), each gathered whole."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    zero = engine.zero_optimization_stage()
    if zero == 1:   # link the expert groups' state too (see test_deepspeed_checkpoint_layout._moments)
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, param in engine.module.named_parameters():
        if zero == 0:
            state = {key: engine.optimizer.state[param][key].clone() for key in ("exp_avg", "exp_avg_sq")}
        else:
            state = {key: safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
            state["fp32"] = safe_get_full_fp32_param(param)
        out[name] = {key: _whole(param, value) for key, value in state.items()}
    return out


def _continue(engine):
    return {"losses": [_step(engine, step) for step in (STEPS, STEPS + 1)]}


def _counters(engine):
    return engine.global_steps, engine.global_samples, engine.get_lr()


def save_worker(rank, world, directory):
    """At 2 stages x 2 ranks, ep_size 2, each ZeRO stage of SAVED: 3 steps, save, the moments and counters, the
    next 2 steps; then a load in the same layout and its next 2 steps."""
    from helpers.deepspeed import setup_worker
    setup_worker(rank, world)
    report = {}
    for zero in SAVED:
        engine = _engine(2, zero, 2)
        for step in range(STEPS):
            _step(engine, step)
        engine.save_checkpoint(os.path.join(directory, f"zero{zero}"), tag="global_step3")
        report[zero] = {"moments": _moments(engine), "counters": _counters(engine), **_continue(engine)}
    engine = _engine(2, 1, 2)
    engine.load_checkpoint(os.path.join(directory, "zero1"))
    report["same"] = {"moments": _moments(engine), "counters": _counters(engine), **_continue(engine)}
    return report


def load_worker(rank, world, directory, stages):
    """Each load of LOADS at `stages` stages, and (at 2 stages) the load of a copy without stage records."""
    from helpers.deepspeed import setup_worker
    setup_worker(rank, world)
    report = {}
    if stages == 2:
        engine = _engine(2, 1, 1)
        try:
            engine.load_checkpoint(os.path.join(directory, "unrecorded"))
            report["unrecorded"] = "loaded"
        except ValueError as error:
            report["unrecorded"] = str(error)
    for saved, loaded in LOADS:
        if loaded[0] == stages:
            engine = _engine(*loaded)
            engine.load_checkpoint(os.path.join(directory, f"zero{saved}"))
            report[saved, loaded] = {"moments": _moments(engine), "counters": _counters(engine),
                                     **_continue(engine)}
    return report


def _merged(results, key):
    """The moments of every parameter (each from the ranks of its stage)."""
    merged = {}
    for result in results:
        merged.update(result[key]["moments"])
    return merged


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pipeline_layouts"))
    saved = run_workers(save_worker, 4, directory, timeout=600)
    unrecorded = os.path.join(directory, "unrecorded")
    shutil.copytree(os.path.join(directory, "zero1"), unrecorded)
    for name in os.listdir(os.path.join(unrecorded, "global_step3")):
        if name.startswith("moe_plugin_layout_stage_"):
            os.remove(os.path.join(unrecorded, "global_step3", name))
    loaded = {stages: run_workers(load_worker, world, directory, stages, timeout=600)
              for stages, world in ((2, 2), (1, 2), (4, 4))}
    return saved, loaded


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pipeline_checkpoint_loads_at_other_stages_ranks_and_ep_sizes_continuing_as_the_saved_layout(runs):
    saved, loaded = runs
    for (zero, to), want in [((saved_zero, to), saved[0][saved_zero]) for saved_zero, to in LOADS]:
        results = loaded[to[0]]
        for result in results:
            got = result[zero, to]
            rel = [abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"])]
            assert max(rel) < 1e-4, (zero, to, got["losses"], want["losses"])
            assert got["counters"] == want["counters"], (zero, to)
    assert saved[0]["same"]["losses"] == saved[0][1]["losses"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_converted_pipeline_load_holds_the_saved_moments_and_masters_bit_for_bit(runs):
    saved, loaded = runs
    cases = [(zero, to, loaded[to[0]], (zero, to)) for zero, to in LOADS] + [(1, (2, 1, 2), saved, "same")]
    for zero, to, results, key in cases:
        want, got = _merged(saved, zero), _merged(results, key)
        assert got.keys() == want.keys(), (zero, to)
        for name, state in got.items():
            assert sorted(state) == ["exp_avg", "exp_avg_sq"] + (["fp32"] if to[1] == 1 else []), (zero, to, name)
            for kind, tensor in state.items():
                assert torch.equal(tensor, want[name][kind]), (zero, to, name, kind)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pipeline_checkpoint_without_its_stage_records_stops_with_one_line_naming_both_layouts(runs):
    _, loaded = runs
    for result in loaded[2]:
        error = result["unrecorded"]
        assert "\n" not in error and "load_optimizer_states=False" in error, error
        assert "saved with world size 4, ep_size 2, ZeRO stage 1, 2 pipeline stage(s)" in error, error
        assert "this run's world size 2, ep_size 1, ZeRO stage 1, 2 pipeline stage(s)" in error, error
        assert "has no moe_plugin_layout_stage_00.json" in error, error


def test_this_stage_gives_each_stage_its_saved_layers_or_names_what_it_does_not_convert(tmp_path):
    """reshard_pipeline.this_stage (no processes): this stage's MoE layers' saved ep_size and expert shapes, or the
    reason layout.py's error gives, which reshard_refusal passes on."""
    import json

    from moe_plugin.integrations.deepspeed.reshard import reshard_refusal
    from moe_plugin.integrations.deepspeed.reshard_pipeline import STAGE_FILE, this_stage
    w1 = ".moe.deepspeed_moe.experts.w1_EDH"
    records = [{"ep_size": {"1.moe": 2}, "experts": {"1" + w1: [2, 32, 48]}, "params": ["0.embed.weight", "1" + w1],
                "moe_layers": ["1.moe"]},
               {"ep_size": {"2.moe": 2}, "experts": {"2" + w1: [2, 32, 48]}, "params": ["2" + w1, "3.out.weight"],
                "moe_layers": ["2.moe"]}]
    for stage, record in enumerate(records):
        (tmp_path / STAGE_FILE.format(stage)).write_text(json.dumps(record))
    saved = {"world_size": 4, "zero_stage": 1, "pipeline_stages": 2, "dtype": "fp32", "pipeline_module": True,
             **records[0]}
    current = {"world_size": 2, "zero_stage": 1, "pipeline_stages": 2, "dtype": "fp32", "pipeline_module": True,
               "ep_size": {"2.moe": 1}, "experts": {"2" + w1: [4, 32, 48]}}
    view = this_stage(str(tmp_path), saved, current)
    assert view["ep_size"] == {"2.moe": 2} and view["experts"] == {"2" + w1: [2, 32, 48]}
    assert view["stages"] == records and reshard_refusal(view, current) is None
    refused = {
        "a PipelineModule saved at ZeRO stage 1 in bf16 (converted: ZeRO 0 and 1 in fp32)": (
            {**saved, "dtype": "bf16"}, {**current, "dtype": "bf16"}),
        "only this run's model is a PipelineModule": ({**saved, "pipeline_module": False}, current),
        "only the saved model is a PipelineModule": (saved, {**current, "pipeline_module": False,
                                                             "pipeline_stages": 1}),
        "the checkpoint has no moe_plugin_layout_stage_02.json": ({**saved, "pipeline_stages": 3}, current),
    }
    for reason, (saved_layout, current_layout) in refused.items():
        got = reshard_refusal(this_stage(str(tmp_path), saved_layout, current_layout), current_layout)
        assert got is not None and reason in got, (reason, got)
    (tmp_path / STAGE_FILE.format(1)).write_text(json.dumps({**records[1], "ep_size": {}, "experts": {}}))
    got = reshard_refusal(this_stage(str(tmp_path), saved, current), current)
    assert got is not None and "saved pipeline stage 1 holds no MoE layer" in got, got
    plain = {**saved, "pipeline_module": False, "pipeline_stages": 1}
    assert this_stage(str(tmp_path), plain, {**current, "pipeline_module": False}) is plain
