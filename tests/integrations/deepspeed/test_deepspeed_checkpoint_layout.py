"""DeepSpeed MoE checkpoints loaded in another layout, and ZeRO-1/2 consolidation of their experts.

A model of `deepspeed.moe.layer.MoE` layers with a "moe" section (backend tutel, dropless, Adam with eps 1e-6 and a
WarmupLR schedule, fp32, no balance loss in the objective) trains 4 steps and saves at ZeRO 0-3: on 2 gloo processes
at ep_size 2 and 1, and on 1 process. Every checkpoint is loaded with plain engine.load_checkpoint(dir) on 2 processes
at ep_size 2 and 1 and on 1 process (the 2-process ones), and at another ZeRO stage; ZeRO-3 checkpoints also at
ZeRO 0-2 (ZERO3), ZeRO 0-2 ones at ZeRO 3 (INTO_ZERO3), bf16 and fp16 ones at ZeRO 1-2 (HALF_CASES), and 2-process
ones on 4 processes at ep_size 4 and 2 (ON_FOUR). Each load
continues as the uninterrupted run in the saved layout does (its next step on the same global batch; a probe's
outputs, rel 1e-4, exact in the same layout; bf16/fp16: as near as their arithmetic allows), with every parameter's
moments and fp32 master gathered whole bit-equal to the saved run's (ZeRO 0: the weights are the masters), and its
counters, lr and fp16's loss scale as saved. What
cannot be converted stops with one line naming why (test_what_cannot_be_converted_is_named_and_what_can_is_not).

The ZeRO-1/2 checkpoints at ep_size 2 consolidate (DeepSpeed's get_fp32_state_dict_from_zero_checkpoint with the hook
on, and `python -m moe_plugin.integrations.deepspeed.zero_to_fp32`) into every expert whole, equal to the weights
gathered from the ranks at save.

A dense model (no "moe" section) gets exactly DeepSpeed's own results with the hook on as with it off, at ZeRO 0-3:
deepspeed.initialize, training, the checkpoint's files, a load, and zero_to_fp32 (the same tensors, or at ZeRO 0 the
same error).
"""
import os

import pytest
import torch

pytest.importorskip("deepspeed")
from helpers.launch import run_workers

STAGES = (0, 1, 2, 3)
STEPS = 4
HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _engine(stage, ep_size, micro_batch, universal=False, precision="fp32"):
    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM
    section = {"backend": "tutel", "num_experts": 4, "top_k": 2, "drop_tokens": False, "ep_size": ep_size}
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "eps": 1e-6, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "moe": section}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        if stage == 1:   # DeepSpeed's BF16_Optimizer; ZeRO 2 keeps its own (DeepSpeedZeroOptimizer)
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    if precision == "fp16":
        # DeepSpeed refuses fp16 on a CPU without mkldnn's fp16 ("Type fp16 is not supported on your device"),
        # though torch runs these half kernels on CPU
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
        # the scale doubles every 2 steps without overflow: by the save it is no longer the initial one
        config["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2}
    engine, _, _, _ = dsi.initialize(model=MoETransformerLM(section, seed=1), config=config)
    return engine


def _batches(world, rank, step):
    """This rank's part of the global batch of a step (8 sequences per rank of 2; on 1 process, both parts; on 4,
    each rank of 2's part halved)."""
    from moe_plugin.integrations.deepspeed.model import synthetic_batch
    parts = [synthetic_batch(torch.Generator().manual_seed(1000 * step + r), 8, 32, 64) for r in range(2)]
    if world == 4:
        return parts[rank // 2][4 * (rank % 2):4 * (rank % 2) + 4]
    return parts[rank] if world == 2 else torch.cat(parts)


def _step(engine, world, rank, step):
    from moe_plugin.integrations.deepspeed.model import lm_loss
    engine.backward(lm_loss(engine, _batches(world, rank, step)))
    engine.step()


def _probe(engine):
    from moe_plugin.integrations.deepspeed.model import synthetic_batch
    tokens = synthetic_batch(torch.Generator().manual_seed(99), 8, 32, 64)
    engine.eval()
    with torch.no_grad():
        y = engine(tokens[:, :-1])
    engine.train()
    return y.float()


def _whole(param, tensor):
    """tensor (param's piece of the model: an expert tensor's local experts) with every expert (consecutive ranks:
    the expert-parallel group is the whole world at ep_size 2 on 2 processes)."""
    import torch.distributed as dist
    if getattr(param, "allreduce", True) is False and dist.get_world_size() > 1 and param.group_name != "ep_size_1":
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)
    return tensor


def _gathered(engine):
    """Every parameter whole (ZeRO 0-2)."""
    return {name: _whole(param, param.detach().clone()) for name, param in engine.module.named_parameters()}


def _moments(engine):
    """Each parameter's fp32 master weight (ZeRO 0: the weight), exp_avg and exp_avg_sq, gathered whole; in bf16, the
    weight too (checked to be the master cast)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    if engine.zero_optimization_stage() in (1, 2):
        # DeepSpeed links each parameter to its state after the first step of group 0, before the later (expert)
        # groups have state: safe_get_full_optimizer_state then fails on experts ("exp_avg not found")
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, param in engine.module.named_parameters():
        if engine.zero_optimization_stage() == 0:
            state = {key: engine.optimizer.state[param][key].clone() for key in ("exp_avg", "exp_avg_sq")}
            state["fp32"] = param.detach().clone()
        else:
            state = {key: safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
            state["fp32"] = safe_get_full_fp32_param(param)
        if param.dtype in HALF:
            state[HALF[param.dtype]] = param.detach().clone()
        out[name] = {key: _whole(param, value) for key, value in state.items()}
    return out


def _source(directory, stage, world, ep_size):
    return os.path.join(directory, f"zero{stage}_world{world}_ep{ep_size}")


SAVED = {2: ((2, 2), (2, 1), (1, 1)), 1: ((2, 2), (2, 1))}   # (world, ep_size) of the checkpoints each world loads
RESTAGED = ((0, 1), (1, 2), (2, 0), (3, 2))                   # (saved, loaded) ZeRO stage, on 1 process at ep_size 1


# ZeRO 3 checkpoints loaded at ZeRO 0-2: saved (world, ep_size), loaded (ZeRO stage, world, ep_size)
ZERO3 = (((2, 2), (1, 2, 1)), ((2, 2), (0, 1, 1)), ((2, 1), (2, 2, 2)), ((1, 1), (2, 2, 2)))
# ZeRO 0-2 checkpoints loaded at ZeRO 3: saved (ZeRO stage, world, ep_size), loaded (world, ep_size)
INTO_ZERO3 = (((0, 2, 2), (1, 1)), ((1, 2, 2), (1, 1)), ((2, 2, 2), (1, 1)), ((0, 2, 1), (2, 2)), ((2, 2, 1), (2, 2)),
              ((1, 1, 1), (2, 2)))
# bf16 (ZeRO 1: BF16_Optimizer; ZeRO 2: DeepSpeedZeroOptimizer) and fp16 (DeepSpeedZeroOptimizer at ZeRO 1 and 2):
# (saved, loaded) (ZeRO stage, world, ep_size)
HALF_CASES = {"bf16": (((2, 2, 2), (2, 2, 1)), ((2, 2, 2), (1, 1, 1)), ((1, 1, 1), (2, 2, 2))),
              "fp16": (((2, 2, 2), (2, 2, 1)), ((2, 2, 2), (1, 1, 1)))}


def _loss_scale(engine):
    """The loss scaler's state (None where the optimizer or its scaler has none: bf16)."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return tuple(getattr(scaler, key, None) for key in ("cur_scale", "cur_iter", "last_overflow_iter")) + (
        getattr(engine.optimizer, "overflow", None),)


def half_part(rank, world, directory, save, report):
    """The bf16 and fp16 checkpoints of HALF_CASES saved on this world (their moments, lr and loss scale, the
    uninterrupted run's next step), or loaded on it (the same as loaded, the next step)."""
    for precision, cases in HALF_CASES.items():
        for saved, loaded in cases:
            stage, saved_world, ep_size = saved
            folder = os.path.join(directory, f"{precision}_zero{stage}_world{saved_world}_ep{ep_size}")
            if save and saved_world == world and (precision, saved) not in report["next"]:
                engine = _engine(stage, ep_size, 16 // world, precision=precision)
                for step in range(STEPS):
                    _step(engine, world, rank, step)
                engine.save_checkpoint(folder, tag="global_step4")
                report["moments"][precision, saved] = _moments(engine)
                report["steps"][precision, saved] = (engine.global_steps, engine.global_samples, engine.get_lr(),
                                                     _loss_scale(engine))
                _step(engine, world, rank, STEPS)
                report["next"][precision, saved] = _probe(engine)
            elif not save and loaded[1] == world:
                engine = _engine(loaded[0], loaded[2], 16 // world, precision=precision)
                engine.load_checkpoint(folder)
                report["steps"][precision, saved, loaded] = (engine.global_steps, engine.global_samples,
                                                             engine.get_lr(), _loss_scale(engine))
                report["moments"][precision, saved, loaded] = _moments(engine)
                _step(engine, world, rank, STEPS)
                report["loaded"][precision, saved, loaded] = _probe(engine)


def _load_and_step(engine, folder, world, rank):
    """The probe after the next step, or the load's ValueError."""
    try:
        engine.load_checkpoint(folder)   # the tag from 'latest'
    except ValueError as error:
        return str(error)
    _step(engine, world, rank, STEPS)
    return _probe(engine)


def _load_converted(engine, folder, world, rank, report, case):
    """Load folder (another layout: converted), keeping the counters, lr and moments as loaded and the next step."""
    engine.load_checkpoint(folder)
    report["steps"][case] = (engine.global_steps, engine.global_samples, engine.get_lr())
    report["moments"][case] = _moments(engine)
    _step(engine, world, rank, STEPS)
    report["loaded"][case] = _probe(engine)


def layout_worker(rank, world, directory, save):
    """Save at every stage (on 2 processes at ep_size 2 and 1, on 1 at ep_size 1), keeping the moments and the
    uninterrupted run's next step; or load each checkpoint of SAVED at each ep_size, keeping the moments as loaded
    and the next step. Results keyed by (stage, saved world, saved ep, loaded ep)."""
    from helpers.deepspeed import setup_worker
    os.environ["MOE_PLUGIN_KERNELS"] = "torch"
    setup_worker(rank, world)
    report = {"next": {}, "loaded": {}, "gathered": {}, "moments": {}, "steps": {}, "restaged": {}, "lr": {}}
    for stage in STAGES:
        if save:
            for ep_size in ((2, 1) if world == 2 else (1,)):
                engine = _engine(stage, ep_size, 16 // world)
                for step in range(STEPS):
                    _step(engine, world, rank, step)
                engine.save_checkpoint(_source(directory, stage, world, ep_size), tag="global_step4")
                if stage in (1, 2) and ep_size == 2:
                    report["gathered"][stage] = _gathered(engine)
                report["moments"][stage, world, ep_size] = _moments(engine)
                report["lr"][stage, world, ep_size] = engine.get_lr()
                _step(engine, world, rank, STEPS)
                report["next"][stage, world, ep_size] = _probe(engine)
            continue
        for saved_world, saved_ep in SAVED[world]:
            for loaded_ep in ((2, 1) if world == 2 else (1,)):
                case = stage, saved_world, saved_ep, loaded_ep
                engine = _engine(stage, loaded_ep, 16 // world)
                try:
                    engine.load_checkpoint(_source(directory, stage, saved_world, saved_ep))   # the tag from 'latest'
                except ValueError as error:
                    report["loaded"][case] = str(error)
                    continue
                report["steps"][case] = (engine.global_steps, engine.global_samples, engine.get_lr())
                report["moments"][case] = _moments(engine)
                _step(engine, world, rank, STEPS)
                report["loaded"][case] = _probe(engine)
    half_part(rank, world, directory, save, report)
    for (saved_world, saved_ep), (stage, loaded_world, loaded_ep) in ZERO3:
        if not save and loaded_world == world:
            case = "zero3", (saved_world, saved_ep), (stage, loaded_world, loaded_ep)
            _load_converted(_engine(stage, loaded_ep, 16 // world), _source(directory, 3, saved_world, saved_ep),
                            world, rank, report, case)
    for saved, (loaded_world, loaded_ep) in INTO_ZERO3:
        if not save and loaded_world == world:
            _load_converted(_engine(3, loaded_ep, 16 // world), _source(directory, *saved), world, rank, report,
                            ("into zero3", saved, (loaded_world, loaded_ep)))
    if world == 1 and not save:
        for saved_stage, stage in RESTAGED:
            folder = _source(directory, saved_stage, 2, 2)
            report["restaged"][saved_stage, stage] = _load_and_step(_engine(stage, 1, 16), folder, world, rank)
        report["universal"] = _load_and_step(_engine(2, 1, 16, universal=True), _source(directory, 2, 2, 2), world,
                                             rank)
    return report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("layouts"))
    saved_one = run_workers(layout_worker, 1, directory, True, timeout=300)
    saved_two = run_workers(layout_worker, 2, directory, True, timeout=600)
    two = run_workers(layout_worker, 2, directory, False, timeout=600)
    one = run_workers(layout_worker, 1, directory, False, timeout=300)
    return directory, {**saved_one[0]["next"], **saved_two[0]["next"]}, two, one, saved_one, saved_two


def _fits(stage, saved_world, saved_ep, loaded_ep, world):
    return saved_ep == loaded_ep and (world == saved_world or stage == 0)


@pytest.mark.timeout(900)
def test_each_load_continues_as_the_saved_layout(runs):
    """ZeRO 0-3 load at every other world size and ep_size with the optimizer state converted (ZeRO 3 into ZeRO 3
    too); DeepSpeed's own load in the saved layout, exact."""
    _, want_next, two, one, saved_one, saved_two = runs
    want_lr = {**saved_one[0]["lr"], **saved_two[0]["lr"]}
    checked = []
    for world, report in ((2, two[0]), (1, one[0])):
        for key, got in report["loaded"].items():
            if key[0] in ("bf16", "fp16", "zero3", "into zero3"):
                continue
            stage, saved_world, saved_ep, loaded_ep = key
            case = (f"ZeRO-{stage}, saved on {saved_world} process(es) at ep_size {saved_ep}, loaded on {world} at "
                    f"{loaded_ep}")
            want = want_next[stage, saved_world, saved_ep]
            assert isinstance(got, torch.Tensor), f"{case}: {got}"
            rel = ((got - want).norm() / want.norm()).item()
            exact = _fits(stage, saved_world, saved_ep, loaded_ep, world) and world == saved_world
            assert rel == 0 if exact else rel < 1e-4, (case, rel)
            assert report["steps"][key] == (STEPS, 16 * STEPS, want_lr[stage, saved_world, saved_ep]), case
            checked.append((world, stage, saved_world, saved_ep, loaded_ep))
    assert len(checked) == len(STAGES) * (3 * 2 + 2), checked


# 2-process checkpoints loaded on 4 processes: (saved ZeRO stage, loaded ZeRO stage, loaded ep_size), saved at ep_size 2
ON_FOUR = ((2, 2, 4), (1, 1, 2), (3, 3, 4))


def four_worker(rank, world, directory):
    """Each ON_FOUR load on 4 processes: its counters and lr as loaded, and its next step."""
    from helpers.deepspeed import setup_worker
    os.environ["MOE_PLUGIN_KERNELS"] = "torch"
    setup_worker(rank, world)
    report = {}
    for saved_stage, stage, ep_size in ON_FOUR:
        engine = _engine(stage, ep_size, 16 // world)
        engine.load_checkpoint(_source(directory, saved_stage, 2, 2))
        steps = (engine.global_steps, engine.global_samples, engine.get_lr())
        _step(engine, world, rank, STEPS)
        report[saved_stage, stage, ep_size] = steps, _probe(engine)
    return report


@pytest.mark.timeout(900)
def test_two_process_checkpoints_continue_on_four_processes(runs):
    """Saved on 2 processes at ep_size 2 (ZeRO 1, 2, 3), loaded on 4 at ep_size 4 or 2: as the saved run goes on."""
    directory, want_next, _, _, _, saved_two = runs
    report = run_workers(four_worker, 4, directory, timeout=600)[0]
    assert sorted(report) == sorted(ON_FOUR)
    for (saved_stage, stage, ep_size), (steps, got) in report.items():
        want = want_next[saved_stage, 2, 2]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-4, (saved_stage, stage, ep_size, rel)
        assert steps == (STEPS, 16 * STEPS, saved_two[0]["lr"][saved_stage, 2, 2]), (saved_stage, stage, ep_size)


@pytest.mark.timeout(900)
def test_a_checkpoint_loads_at_another_zero_stage(runs):
    """Saved on 2 processes at ep_size 2, loaded on 1 at ep_size 1 and another ZeRO stage (into ZeRO 3: INTO_ZERO3)."""
    _, want_next, _, one, _, _ = runs
    for (saved_stage, stage), got in one[0]["restaged"].items():
        want = want_next[saved_stage, 2, 2]
        assert isinstance(got, torch.Tensor), (saved_stage, stage, got)
        assert ((got - want).norm() / want.norm()).item() < 1e-4, (saved_stage, stage)
    assert len(one[0]["restaged"]) == len(RESTAGED)


@pytest.mark.timeout(900)
def test_deepspeed_s_universal_load_is_refused_for_moe_models_naming_why(runs):
    from moe_plugin.integrations.deepspeed.layout import UNIVERSAL_REFUSED
    assert runs[3][0]["universal"] == UNIVERSAL_REFUSED
    assert "issue 5716" in UNIVERSAL_REFUSED and "engine.load_checkpoint(dir)" in UNIVERSAL_REFUSED


@pytest.mark.timeout(900)
def test_each_converted_load_holds_the_saved_moments_and_master_weights_bit_for_bit(runs):
    _, _, two, one, saved_one, saved_two = runs
    saved = {**saved_one[0]["moments"], **saved_two[0]["moments"]}
    cases = [(case, moments) for report in (two[0], one[0]) for case, moments in report["moments"].items()
             if case[0] not in ("bf16", "fp16", "zero3", "into zero3")]
    assert len(cases) == len(STAGES) * (3 * 2 + 2), [case for case, _ in cases]
    for (stage, saved_world, saved_ep, loaded_ep), got in cases:
        want = saved[stage, saved_world, saved_ep]
        assert got.keys() == want.keys()
        for name, state in want.items():
            assert state.keys() == got[name].keys() == {"exp_avg", "exp_avg_sq", "fp32"}, name
            for key, tensor in state.items():
                assert torch.equal(got[name][key], tensor), (stage, saved_world, saved_ep, loaded_ep, name, key)


@pytest.mark.timeout(900)
def test_zero3_checkpoints_load_at_zero_0_to_2_in_another_layout_with_their_state(runs):
    """ZeRO 3 saved at ep_size 2 and 1 on 2 processes and on 1, loaded at ZeRO 0, 1, 2 at another world size and
    ep_size: the weights, moments and masters as the ZeRO-3 run held them, bit for bit, and its next step."""
    _, want_next, two, one, saved_one, saved_two = runs
    saved = {**saved_one[0]["moments"], **saved_two[0]["moments"]}
    got = {case: (report["loaded"][case], report["moments"][case], report["steps"][case])
           for report in (two[0], one[0]) for case in report["loaded"] if case[0] == "zero3"}
    assert sorted(got) == sorted(("zero3", *case) for case in ZERO3)
    for (_, (saved_world, saved_ep), to), (probe, moments, steps) in got.items():
        want = saved[3, saved_world, saved_ep]
        assert moments.keys() == want.keys()
        for name, state in moments.items():
            assert state.keys() == {"exp_avg", "exp_avg_sq", "fp32"}, (to, name)
            for key, tensor in state.items():
                assert torch.equal(tensor, want[name][key]), (saved_world, saved_ep, to, name, key)
        assert steps[:2] == (STEPS, 16 * STEPS), to
        rel = ((probe - want_next[3, saved_world, saved_ep]).norm() / want_next[3, saved_world, saved_ep].norm()).item()
        assert rel < 1e-4, (saved_world, saved_ep, to, rel)


@pytest.mark.timeout(900)
def test_zero_0_to_2_checkpoints_load_at_zero_3_in_another_layout_with_their_state(runs):
    """ZeRO 0, 1 and 2 saved on 2 processes at ep_size 2 and 1 and on 1 process, loaded at ZeRO 3 at another world
    size and ep_size (ZeRO 3 into ZeRO 3: test_each_load_continues_as_the_saved_layout): each parameter's fp32 master,
    exp_avg and exp_avg_sq gathered whole from the ZeRO-3 partitions bit-equal to the saved run's, its counters and
    lr, and its next step."""
    _, want_next, two, one, saved_one, saved_two = runs
    saved = {**saved_one[0]["moments"], **saved_two[0]["moments"]}
    want_lr = {**saved_one[0]["lr"], **saved_two[0]["lr"]}
    got = {case: (report["loaded"][case], report["moments"][case], report["steps"][case])
           for report in (two[0], one[0]) for case in report["loaded"] if case[0] == "into zero3"}
    assert sorted(got) == sorted(("into zero3", *case) for case in INTO_ZERO3)
    for (_, from_, to), (probe, moments, steps) in got.items():
        want = saved[from_]
        assert moments.keys() == want.keys()
        for name, state in want.items():
            assert state.keys() == moments[name].keys() == {"exp_avg", "exp_avg_sq", "fp32"}, name
            for key, tensor in state.items():
                assert torch.equal(moments[name][key], tensor), (from_, to, name, key)
        assert steps[:2] == (STEPS, 16 * STEPS), (from_, to)
        assert steps[2] == want_lr[from_], (from_, to, steps[2])
        rel = ((probe - want_next[from_]).norm() / want_next[from_].norm()).item()
        assert rel < 1e-4, (from_, to, rel)


def _check_half_loads(runs, precision, most):
    """The HALF_CASES loads of precision: fp32 masters and moments bit-equal to the saved run's, the 16-bit weights
    the masters cast, the counters, lr (and fp16's loss scale) as saved, the next step within most of the saved
    layout's."""
    _, want_next, two, one, saved_one, saved_two = runs
    saved = {**saved_one[0]["moments"], **saved_two[0]["moments"]}
    saved_steps = {**saved_one[0]["steps"], **saved_two[0]["steps"]}
    got = {case: (report["loaded"][case], report["moments"][case], report["steps"][case])
           for report in (two[0], one[0]) for case in report["loaded"] if case[0] == precision}
    assert sorted(got) == sorted((precision, *case) for case in HALF_CASES[precision])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for (_, from_, to), (probe, moments, steps) in got.items():
        want = saved[precision, from_]
        assert moments.keys() == want.keys()
        for name, state in want.items():
            assert state.keys() == moments[name].keys() == {"exp_avg", "exp_avg_sq", "fp32", precision}, name
            for key, tensor in state.items():
                assert torch.equal(moments[name][key], tensor), (from_, to, name, key)
            assert torch.equal(moments[name]["fp32"].to(dtype), moments[name][precision]), (from_, to, name)
        assert steps[:2] == (STEPS, 16 * STEPS), (from_, to, steps)
        # the loss scale where there is one (bf16 ZeRO 1's BF16_Optimizer has none, ZeRO 2's a fixed 1.0)
        compared = 4 if precision == "fp16" else 3
        assert steps[:compared] == saved_steps[precision, from_][:compared], (from_, to, steps)
        rel = ((probe - want_next[precision, from_]).norm() / want_next[precision, from_].norm()).item()
        assert rel < most, (from_, to, rel)


@pytest.mark.timeout(900)
def test_bf16_checkpoints_convert_at_zero_1_and_2_with_masters_and_moments_bit_for_bit(runs):
    """bf16 saved and loaded at another world size, ep_size and ZeRO stage (1: BF16_Optimizer, 2: ZeRO's own): the
    fp32 masters and moments bit-equal, the bf16 weights the masters cast, the counters and lr as saved. The next
    step is as near the saved layout's as bf16 arithmetic allows: two fresh bf16 runs on 1 and on 2 processes
    differ by 6e-2 to 9e-2 after their first steps with a nonzero lr (fp32: 0 to 7e-4), so only the state can be
    compared exactly; the converted loads measured 3e-2 to 6e-2, weights-only loads 0.76."""
    _check_half_loads(runs, "bf16", 2e-1)


@pytest.mark.timeout(900)
def test_fp16_checkpoints_convert_at_zero_1_and_2_with_masters_moments_and_loss_scale(runs):
    """fp16 (DeepSpeedZeroOptimizer, a dynamic loss scale that doubled once before the save) saved on 2 processes
    at ep_size 2 at ZeRO 2, loaded on 2 at ep_size 1 and at ZeRO 1 on 1: as bf16, and the loss scaler's state
    (scale, its iteration, the last overflow) as saved. Two fresh fp16 runs on 1 and on 2 processes differ by
    3.2e-2 after 5 steps; the converted loads measured 7.5e-4 and 1.1e-2, weights-only loads 0.57."""
    _check_half_loads(runs, "fp16", 5e-2)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_expert_checkpoints_consolidate_into_the_gathered_experts(runs, stage, tmp_path):
    from deepspeed.utils import zero_to_fp32

    from moe_plugin.integrations.deepspeed import consolidate
    directory, _, _, _, _, saved_two = runs
    want = saved_two[0]["gathered"][stage]
    assert want["blocks.0.ffn.moe.deepspeed_moe.experts.w1_EDH"].shape[0] == 4   # every expert
    source = _source(directory, stage, 2, 2)
    consolidate.patch_zero_to_fp32()
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(source)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    consolidate.main([source, str(tmp_path / "out")])   # python -m moe_plugin.integrations.deepspeed.zero_to_fp32
    written = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(written[name], tensor) for name, tensor in want.items())


def _dense_engine(stage, seed=5):
    import deepspeed
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 16))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, optimizer


def _dense_step(engine, rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 16, generator=generator), torch.randn(4, 16, generator=generator)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def dense_worker(rank, world, directory):
    """A dense model through plain deepspeed.initialize at ZeRO 0-3, the hook on and off: training, the checkpoint's
    files, and a load that trains on."""
    from helpers.deepspeed import setup_worker

    from moe_plugin.integrations.deepspeed import hook
    setup_worker(rank, world)
    report = {}
    for stage in STAGES:
        for on in (True, False):
            hook.enable() if on else hook.disable()
            engine, optimizer = _dense_engine(stage)
            losses = [_dense_step(engine, rank, step) for step in range(3)]
            folder = os.path.join(directory, f"dense_zero{stage}_hook_{'on' if on else 'off'}")
            engine.save_checkpoint(folder, tag="global_step3")
            loaded, _ = _dense_engine(stage, seed=6)
            loaded.load_checkpoint(folder)
            losses.append(_dense_step(loaded, rank, 3))
            report[stage, on] = {"engine": type(engine).__name__, "optimizer": type(optimizer).__name__,
                                 "wrapped": sorted({"save_checkpoint", "load_checkpoint", "step"} & set(vars(engine))),
                                 "losses": losses, "files": sorted(os.listdir(os.path.join(folder, "global_step3")))}
    hook.enable()
    return report


def _consolidated(folder):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    try:
        return get_fp32_state_dict_from_zero_checkpoint(folder)
    except Exception as error:   # DeepSpeed's own answer, compared as it is
        return f"{type(error).__name__}: {error}"


@pytest.mark.timeout(400)
def test_dense_models_get_exactly_deepspeed_s_own_results_with_the_hook_on(tmp_path):
    """Issue 58 item 5: initialize, save/load and zero_to_fp32 with the hook on against the hook off, ZeRO 0-3."""
    import deepspeed
    from deepspeed.utils import zero_to_fp32

    from moe_plugin.integrations.deepspeed import hook
    reports = run_workers(dense_worker, 2, str(tmp_path), timeout=300)
    before = deepspeed.initialize, zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint
    try:
        for stage in STAGES:
            for report in reports:
                assert report[stage, True] == report[stage, False], stage
                assert report[stage, True]["wrapped"] == [], stage
            answers = {}
            for on in (True, False):
                hook.enable() if on else hook.disable()
                answers[on] = [_consolidated(str(tmp_path / f"dense_zero{stage}_hook_{side}")) for side in ("on", "off")]
            for got, want in zip(answers[True], answers[False]):
                if isinstance(want, str):
                    assert stage == 0 and got == want, (stage, want, got)
                    continue
                assert got.keys() == want.keys() and len(want) == 6, stage
                assert all(torch.equal(got[name], want[name]) for name in want), stage
            if stage:   # the checkpoints of both runs consolidate to the same weights
                assert all(torch.equal(answers[False][0][k], answers[False][1][k]) for k in answers[False][1])
    finally:
        deepspeed.initialize, zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint = before


def hf_worker(rank, world, directory):
    """A Mixtral swapped by a "moe" section (ep_size 2, ZeRO-2) trains 2 steps and saves; its gathered weights."""
    import moe_plugin.integrations.transformers  # noqa: F401  (before transformers' models)
    from helpers.deepspeed import setup_worker
    from helpers.hf import build_model, tokens

    import moe_plugin.integrations.deepspeed as dsi
    setup_worker(rank, world)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "moe": {"backend": "tutel", "ep_size": 2}}
    engine = dsi.initialize(model=build_model("mixtral", seed=1), config=config)[0]
    for i in range(2):
        ids = tokens(seed=10 * i + rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(directory)
    return _gathered(engine)


@pytest.mark.timeout(300)
def test_an_hf_model_s_zero2_checkpoint_at_ep_size_2_consolidates_into_the_gathered_weights(tmp_path):
    """Issue 58 item 5: `python -m moe_plugin.integrations.deepspeed.zero_to_fp32` on such a checkpoint stopped with
    "'NoneType' object has no attribute 'group'"."""
    from moe_plugin.integrations.deepspeed import consolidate
    want = run_workers(hf_worker, 2, str(tmp_path / "ckpt"), timeout=240)[0]
    consolidate.main([str(tmp_path / "ckpt"), str(tmp_path / "out")])
    got = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    experts = [name for name in want if ".experts." in name]
    assert experts and all(want[name].shape[0] == 6 for name in experts), experts
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_the_world_size_may_change_only_where_no_rank_holds_a_partition():
    """Plain ZeRO 0 keeps the whole optimizer state on each rank; bf16 at ZeRO 0 (DeepSpeed's BF16_Optimizer) and
    ZeRO 1-3 split it over the data-parallel ranks."""
    from moe_plugin.integrations.deepspeed.layout import fits
    base = {"zero_stage": 0, "pipeline_stages": 1, "ep_size": {"a": 1}, "world_size": 2, "partitioned": False}
    assert fits(base, {**base, "world_size": 1})
    assert not fits({**base, "partitioned": True}, {**base, "world_size": 1, "partitioned": True})
    assert not fits({**base, "zero_stage": 1, "partitioned": True},
                    {**base, "zero_stage": 1, "partitioned": True, "world_size": 4})
    assert not fits(base, {**base, "ep_size": {"a": 2}}) and not fits(base, {**base, "pipeline_stages": 2})
    assert not fits(base, {**base, "zero_stage": 1, "partitioned": True})


def test_what_cannot_be_converted_is_named_and_what_can_is_not():
    """reshard_refusal, the reason layout.py's error gives (None: the optimizer state is converted at load)."""
    from moe_plugin.integrations.deepspeed.reshard import reshard_refusal
    expert = "blocks.0.ffn.moe.deepspeed_moe.experts.w1_EDH"
    base = {"world_size": 2, "zero_stage": 2, "pipeline_stages": 1, "ep_size": {"blocks.0.ffn.moe": 2},
            "dtype": "fp32", "experts": {expert: [2, 32, 64]}}
    to_one = {**base, "world_size": 1, "ep_size": {"blocks.0.ffn.moe": 1}, "experts": {expert: [4, 32, 64]}}
    assert reshard_refusal(base, to_one) is None
    assert reshard_refusal(base, {**to_one, "zero_stage": 0, "optimizer_names": [[expert]]}) is None
    assert reshard_refusal({**base, "dtype": "bf16"}, {**to_one, "dtype": "bf16", "zero_stage": 1}) is None
    assert reshard_refusal({**base, "dtype": "fp16"}, {**to_one, "dtype": "fp16", "zero_stage": 1}) is None
    assert reshard_refusal({**base, "zero_stage": 3}, to_one) is None
    assert reshard_refusal(base, {**to_one, "zero_stage": 3}) is None
    assert reshard_refusal({**base, "zero_stage": 3}, {**to_one, "zero_stage": 3}) is None
    zero0 = {**base, "zero_stage": 0, "optimizer_names": [[expert]]}
    assert reshard_refusal(zero0, {**to_one, "zero_stage": 3}) is None
    refused = {
        "the saved ZeRO stage is 3 in bf16 (converted: fp32)": ({**base, "zero_stage": 3, "dtype": "bf16"},
                                                                {**to_one, "dtype": "bf16"}),
        "this run's ZeRO stage is 3 in bf16 (converted: fp32)": ({**base, "dtype": "bf16"},
                                                                {**to_one, "zero_stage": 3, "dtype": "bf16"}),
        "this run's ZeRO stage is 4 (converted: into 0, 1, 2, 3)": (base, {**to_one, "zero_stage": 4}),
        "the saved layout has 2 pipeline stages (converted: 1)": ({**base, "pipeline_stages": 2}, to_one),
        "this run's precision is fp8 (converted: fp32, and bf16 and fp16 at ZeRO 1 and 2)": (base, {**to_one,
                                                                                            "dtype": "fp8"}),
        "the saved precision is fp32, this run's fp16 (converted: the same precision)": (base, {**to_one,
                                                                                              "dtype": "fp16"}),
        "this run's precision is fp16 at ZeRO stage 0": ({**base, "dtype": "fp16"}, {**to_one, "dtype": "fp16",
                                                                                     "zero_stage": 0}),
        "the saved ZeRO stage is 3 in fp16 (converted: fp32)": ({**base, "zero_stage": 3, "dtype": "fp16"},
                                                                {**to_one, "dtype": "fp16"}),
        "the saved precision is fp32, this run's bf16 (converted: the same precision)": (base, {**to_one,
                                                                                              "dtype": "bf16"}),
        "this run's precision is bf16 at ZeRO stage 0": ({**base, "dtype": "bf16"}, {**to_one, "dtype": "bf16",
                                                                                     "zero_stage": 0}),
        "the saved precision is not recorded": ({k: v for k, v in base.items() if k != "dtype"}, to_one),
        "the saved MoE layers have different ep_sizes": ({**base, "ep_size": {"a": 2, "b": 1}}, to_one),
        "this run's ZeRO-0 optimizer is not a torch optimizer": (base, {**to_one, "zero_stage": 0}),
        "the expert parameters' names differ": (base, {**to_one, "experts": {"other": [4, 32, 64]}}),
        "not whole experts stacked first": (base, {**to_one, "experts": {expert: [2, 32, 64]}}),
    }
    for reason, (saved, current) in refused.items():
        got = reshard_refusal(saved, current)
        assert got is not None and reason in got, (reason, got)


def test_a_weights_only_load_into_zero_3_of_a_zero_0_to_2_checkpoint_names_the_load_that_works(tmp_path):
    """DeepSpeed's own weights-only load of a ZeRO 0-2 checkpoint into ZeRO 3 fails deep inside (an AssertionError:
    it asks for per-rank ZeRO-3 files): named before it, in one line; other weights-only loads are DeepSpeed's."""
    import json

    from moe_plugin.integrations.deepspeed.layout import LAYOUT_FILE, check_weights_only
    layout = {"world_size": 2, "zero_stage": 2, "pipeline_stages": 1, "ep_size": {"blocks.0.ffn.moe": 2}}
    (tmp_path / LAYOUT_FILE).write_text(json.dumps(layout))
    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match=r"saved with world size 2, ep_size 2, ZeRO stage 2, 1 pipeline stage\(s\); "
                                             r"a weights-only load .* into this run's world size 1, ep_size 1, ZeRO "
                                             r"stage 3, 1 pipeline stage\(s\) is not converted: load it with its "
                                             r"optimizer state \(the default, converted into ZeRO 3\), or at ZeRO "
                                             r"stage 2"):
            check_weights_only(str(tmp_path), {**layout, "world_size": 1, "zero_stage": 3,
                                               "ep_size": {"blocks.0.ffn.moe": 1}})
        check_weights_only(str(tmp_path), {**layout, "zero_stage": stage})
    (tmp_path / LAYOUT_FILE).write_text(json.dumps({**layout, "zero_stage": 3}))
    check_weights_only(str(tmp_path), {**layout, "world_size": 1, "zero_stage": 3})
    check_weights_only(str(tmp_path / "elsewhere"), {**layout, "zero_stage": 3})     # no layout file: DeepSpeed's
