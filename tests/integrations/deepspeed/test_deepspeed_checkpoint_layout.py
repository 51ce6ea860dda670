"""DeepSpeed MoE checkpoints against the layout they are loaded in, and ZeRO-1/2 consolidation of their experts.

A model of `deepspeed.moe.layer.MoE` layers with a "moe" section (backend tutel, dropless, Adam with eps 1e-6, fp32,
no balance loss in the objective) trains 4 steps and saves at ZeRO 0-3, on 2 gloo processes at ep_size 2 and 1.
Every combination that reaches engine.load_checkpoint is loaded: on the same 2 processes at the same and the other
ep_size, and on 1 process (ep_size 1). Each load either continues as the uninterrupted run in the saved layout does
(its next step on the same global batch; a probe's outputs) or stops with the one-line ValueError naming both layouts
and load_optimizer_states=False (layout.py). None is silent.

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


def _engine(stage, ep_size, micro_batch):
    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM
    section = {"backend": "tutel", "num_experts": 4, "top_k": 2, "drop_tokens": False, "ep_size": ep_size}
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "eps": 1e-6, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "moe": section}
    engine, _, _, _ = dsi.initialize(model=MoETransformerLM(section, seed=1), config=config)
    return engine


def _batches(world, rank, step):
    """This rank's part of the global batch of a step (8 sequences per rank of 2; on 1 process, both parts)."""
    from moe_plugin.integrations.deepspeed.model import synthetic_batch
    parts = [synthetic_batch(torch.Generator().manual_seed(1000 * step + r), 8, 32, 64) for r in range(2)]
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
    return y


def _gathered(engine):
    """Every parameter whole (ZeRO 0-2): an expert tensor's local experts gathered over its expert-parallel ranks
    (consecutive ranks: the group is the whole world at ep_size 2 on 2 processes)."""
    import torch.distributed as dist
    out = {}
    for name, param in engine.module.named_parameters():
        tensor = param.detach().clone()
        if getattr(param, "allreduce", True) is False and dist.get_world_size() > 1:
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, tensor)
            tensor = torch.cat(parts)
        out[name] = tensor
    return out


def _source(directory, stage, world, ep_size):
    return os.path.join(directory, f"zero{stage}_world{world}_ep{ep_size}")


def layout_worker(rank, world, directory):
    """On 2 processes: save at every stage and ep_size (the uninterrupted next step kept), then load each checkpoint at
    each ep_size. On 1 process: load each 2-process checkpoint. Results keyed by (stage, saved ep, loaded ep)."""
    from helpers.deepspeed import setup_worker
    os.environ["MOE_PLUGIN_KERNELS"] = "torch"
    setup_worker(rank, world)
    report = {"next": {}, "loaded": {}, "gathered": {}}
    for stage in STAGES:
        if world == 2:
            for ep_size in (2, 1):
                engine = _engine(stage, ep_size, 8)
                for step in range(STEPS):
                    _step(engine, world, rank, step)
                engine.save_checkpoint(_source(directory, stage, world, ep_size), tag="global_step4")
                if stage in (1, 2) and ep_size == 2:
                    report["gathered"][stage] = _gathered(engine)
                _step(engine, world, rank, STEPS)
                report["next"][stage, ep_size] = _probe(engine)
        for saved_ep in (2, 1):
            for loaded_ep in ((2, 1) if world == 2 else (1,)):
                engine = _engine(stage, loaded_ep, 16 // world)
                try:
                    engine.load_checkpoint(_source(directory, stage, 2, saved_ep))   # the tag from 'latest'
                except ValueError as error:
                    report["loaded"][stage, saved_ep, loaded_ep] = str(error)
                    continue
                _step(engine, world, rank, STEPS)
                report["loaded"][stage, saved_ep, loaded_ep] = _probe(engine)
    return report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("layouts"))
    two = run_workers(layout_worker, 2, directory, timeout=600)
    one = run_workers(layout_worker, 1, directory, timeout=300)
    return directory, two, one


def _fits(stage, saved_ep, loaded_ep, world):
    return saved_ep == loaded_ep and (world == 2 or stage == 0)


@pytest.mark.timeout(900)
def test_each_load_continues_as_the_saved_layout_or_stops_with_one_line_naming_both(runs):
    _, two, one = runs
    checked = []
    for world, report in ((2, two[0]), (1, one[0])):
        for (stage, saved_ep, loaded_ep), got in report["loaded"].items():
            case = f"ZeRO-{stage}, saved on 2 processes at ep_size {saved_ep}, loaded on {world} at {loaded_ep}"
            if _fits(stage, saved_ep, loaded_ep, world):
                want = two[0]["next"][stage, saved_ep]
                assert isinstance(got, torch.Tensor), f"{case}: {got}"
                rel = ((got - want).norm() / want.norm()).item()
                assert rel < 1e-4 if world == 1 else rel == 0, (case, rel)
            else:
                assert isinstance(got, str), f"{case}: loaded"
                assert "\n" not in got and "load_optimizer_states=False" in got, (case, got)
                assert f"saved with world size 2, ep_size {saved_ep}, ZeRO stage {stage}, 1 pipeline stage" in got
                assert f"this run's world size {world}, ep_size {loaded_ep}, ZeRO stage {stage}" in got, (case, got)
            checked.append((world, stage, saved_ep, loaded_ep))
    assert len(checked) == len(STAGES) * (4 + 2), checked


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_expert_checkpoints_consolidate_into_the_gathered_experts(runs, stage, tmp_path):
    from deepspeed.utils import zero_to_fp32

    from moe_plugin.integrations.deepspeed import consolidate
    directory, two, _ = runs
    want = two[0]["gathered"][stage]
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
