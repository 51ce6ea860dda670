"""Hugging Face MoE models under DeepSpeed: the "moe" section swaps their blocks; ZeRO 0/1/2 on 2 gloo ranks with
ep_size 2 equals one process on the global batch and trains; checkpoints through the engine; clear errors.

What this module tests (moved here from the README):

- Tested (`tests/integrations/deepspeed/test_deepspeed_hf.py`, torchrun with 2 gloo processes, tiny Mixtral):
  ZeRO-1 with ep_size 2 and ZeRO-2 with ep_size 1; the engine runs the blocks as MoE, the first step
  equals one process's step on both ranks' batches (every parameter, experts gathered), the loss falls,
  non-expert weights stay identical across ranks (and experts too with ep_size 1).
"""
import copy
import json
import os
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
from helpers.hf import (FAMILIES, bias_sign_step, build_model, needs_transformers, save_and_resume,  # noqa: E402
                        tokens, unbiased_deepseek)
from helpers.launch import run_workers  # noqa: E402

pytestmark = needs_transformers
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0}   # DeepSpeed clips at 1.0 by default; the one-process reference does not clip
EPS32 = torch.finfo(torch.float32).eps


def ds_config(stage, optimizer, **moe):
    return {**BASE, "optimizer": optimizer, "zero_optimization": {"stage": stage},
            "moe": {"backend": "tutel", **moe}}


def setup_worker(rank, world):
    import logging

    import deepspeed
    from deepspeed.utils import logger
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")


def step(engine, ids):
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def zero_worker(rank, world, stage, families):
    """Per family: one SGD step of the engine against one process on both ranks' batches, then training."""
    setup_worker(rank, world)
    from moe_plugin.integrations.deepspeed import initialize
    from moe_plugin.integrations.deepspeed.hf import DeepSpeedHFMoEBlock
    from moe_plugin.integrations.transformers import hf_state_dict
    report = {}
    for family in families:
        model = build_model(family, seed=3)
        reference = copy.deepcopy(model)
        lr = 0.5
        engine, _, _, _ = initialize(model=model, config=ds_config(stage, {"type": "SGD", "params": {"lr": lr}},
                                                                   ep_size=2))
        blocks = [m for m in engine.module.modules() if isinstance(m, DeepSpeedHFMoEBlock)]
        batches = [tokens(seed=100 * r + i) for i in range(2) for r in range(world)]   # [i * world + r]
        losses = [step(engine, batches[rank])]
        # one process, the same step on both ranks' batches (DeepSpeed averages the ranks' gradients)
        reference(input_ids=torch.cat(batches[:world]), labels=torch.cat(batches[:world])).loss.backward()
        before = {n: p.detach().clone() for n, p in reference.named_parameters()}
        with torch.no_grad():
            for p in reference.parameters():
                p -= lr * p.grad
        ours = hf_state_dict(engine.module)
        # the difference in units of the step's largest update, less what storing the weight in fp32 may round
        errors = {n: (((ours[n] - p).abs().max() - 4 * EPS32 * before[n].abs().max()).clamp(min=0)
                      / (p - before[n]).abs().max().clamp(min=1e-12)).item() for n, p in reference.named_parameters()}
        for i in range(1, 16):
            losses.append(step(engine, batches[(i % 2) * world + rank]))
        # numpy: tensors would travel through shared memory that dies with this process
        params = {n: p.detach().numpy().copy() for n, p in engine.module.named_parameters()}
        report[family] = dict(
            blocks=len(blocks), ep_groups={b.moe.groups.layout.local_experts for b in blocks}, losses=losses,
            worst=max(errors, key=errors.get), error=max(errors.values()), has_moe=engine.has_moe_layers,
            shared={n: p for n, p in params.items() if ".moe.experts." not in n})
    return report


FAMILY_SPLIT = [FAMILIES[:3], FAMILIES[3:]]   # two runs per stage keep each under the timeout


@pytest.mark.parametrize("families", FAMILY_SPLIT, ids=["+".join(f) for f in FAMILY_SPLIT])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stages_equal_one_process_and_train(stage, families):
    """ep_size 2 on 2 ranks: after one step every parameter (experts gathered, HF names) equals one process's
    step on the global batch; the loss falls; the ranks keep identical non-expert weights."""
    reports = run_workers(zero_worker, 2, stage, families, timeout=400)
    for family in families:
        r0, r1 = reports[0][family], reports[1][family]
        assert r0["has_moe"] and r0["blocks"] >= 2, r0
        assert r0["error"] < 1e-4, f"{family}: {r0['worst']} differs from one process by {r0['error']:.3g} of its update"
        for r in (r0, r1):
            first, last = sum(r["losses"][:2]) / 2, sum(r["losses"][-2:]) / 2
            assert last < first - 0.5, f"{family}: {r['losses']}"
        assert all((r0["shared"][n] == r1["shared"][n]).all() for n in r0["shared"]), family


def probe_logits(engine, ids):
    """The engine's logits on ids in eval mode (collective under expert parallelism: every rank calls it)."""
    engine.eval()
    with torch.no_grad():
        out = engine(input_ids=ids).logits
    engine.train()
    return out


def checkpoint_worker(rank, world, directory, family):
    setup_worker(rank, world)
    import torch.distributed as dist

    from moe_plugin.integrations.deepspeed import initialize
    config = ds_config(2, {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, ep_size=2)

    def engine_from(seed):
        return initialize(model=build_model(family, seed=seed), config=copy.deepcopy(config))[0]

    report, _, engine, resumed = save_and_resume(engine_from, step, probe_logits, directory, rank,
                                                 tokens(seed=50 + rank))
    report["buffers equal"] = all(torch.equal(a, b) for a, b in zip(engine.module.buffers(), resumed.module.buffers()))
    dist.barrier()
    report["files"] = sorted(os.listdir(os.path.join(directory, "t")))
    return report


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_checkpoint_save_and_load_through_the_engine(family, tmp_path):
    """ZeRO-2, ep_size 2: every rank's experts go to DeepSpeed's per-expert files and come back (with the optimizer
    state: training continues exactly); DeepSeek-V3's expert bias and shared experts come back too."""
    for report in run_workers(checkpoint_worker, 2, str(tmp_path), family, timeout=300):
        assert report["fresh differs"] > 1e-3 and report["restored"] == 0.0, report
        assert report["losses"][0] == report["losses"][1] and report["buffers equal"], report
        experts = 8 if family == "deepseek_v3" else 6
        expert_files = {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1)
                        for e in range(experts)}
        assert expert_files <= set(report["files"]), report["files"]


def cluster_worker(rank, world, directory, family, action):
    """"save": train 3 steps at ep_size = world, save, write the probe logits; "load": a fresh engine at
    ep_size = world loads the module (another world size: DeepSpeed's optimizer partitions do not fit) and
    returns its probe logits before and after, with the saved ones."""
    setup_worker(rank, world)
    import torch.distributed as dist

    from moe_plugin.integrations.deepspeed import initialize
    config = ds_config(1, {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, ep_size=world)
    engine = initialize(model=build_model(family, seed=1 if action == "save" else 2), config=config)[0]
    probe = tokens(seed=60)
    if action == "save":
        for i in range(3):
            step(engine, tokens(seed=10 * i + rank))
        engine.save_checkpoint(directory, tag="t")
        saved = probe_logits(engine, probe)     # on every rank: the experts' all-to-all is collective
        if rank == 0:
            torch.save(saved, os.path.join(directory, "probe_logits.pt"))
        dist.barrier()
        return None
    fresh = probe_logits(engine, probe)
    engine.load_checkpoint(directory, tag="t", load_module_only=True)
    saved = torch.load(os.path.join(directory, "probe_logits.pt"))
    report = {"restored": (probe_logits(engine, probe) - saved).abs().max().item(), "fresh differs": (fresh - saved).abs().max().item()}
    report["loss"] = step(engine, tokens(seed=90 + rank))      # and it trains on, with a fresh optimizer
    return report


@pytest.mark.parametrize("save_world, load_world", [(2, 1), (1, 2)])
def test_checkpoint_loads_on_another_number_of_processes(save_world, load_world, tmp_path):
    """A cluster that changes size between runs: DeepSeek-V3 saved with its experts over save_world processes
    loads on load_world (ep_size = world size each time) and computes what it computed."""
    run_workers(cluster_worker, save_world, str(tmp_path), "deepseek_v3", "save", timeout=200)
    for report in run_workers(cluster_worker, load_world, str(tmp_path), "deepseek_v3", "load", timeout=200):
        assert report["fresh differs"] > 1e-3 and report["restored"] < 1e-5, report
        assert report["loss"] == report["loss"], report    # finite, not NaN


def bias_worker(rank, world):
    """DeepSeek-V3 with aux-loss-free balancing (which AutoEP rejects), ep_size 2: one engine step; the expert
    bias of each block before and after, and this rank's batch."""
    setup_worker(rank, world)
    from moe_plugin.integrations.deepspeed import initialize
    config = ds_config(1, {"type": "SGD", "params": {"lr": 0.1}}, ep_size=2, expert_bias_update_rate=0.01)
    engine = initialize(model=unbiased_deepseek(), config=config)[0]
    # lists: tensors would travel through shared memory that dies with this process
    biases = lambda: [m.moe.router.expert_bias_E.tolist() for m in engine.module.modules() if hasattr(m, "moe")]
    before = biases()
    ids = tokens(seed=30 + rank)
    step(engine, ids)
    return {"before": before, "after": biases(), "ids": ids.tolist()}


@pytest.mark.timeout(300)
def test_expert_bias_balancing_on_an_hf_model_updates_from_every_rank_s_choices():
    """engine.step() moves each block's bias by rate * sign(mean load - load) over the choices of both ranks'
    batches, the same on both ranks; the loads counted here by one process on both batches."""
    from moe_plugin.integrations.transformers import swap_moe_blocks
    reports = run_workers(bias_worker, 2, timeout=250)
    reference = swap_moe_blocks(unbiased_deepseek(), expert_bias_update_rate=0.01).train()
    reference(input_ids=torch.tensor([row for r in reports for row in r["ids"]]))
    routers = [m.moe.router for m in reference.modules() if hasattr(m, "moe")]
    totals = [router.take_load() for router in routers]
    reference(input_ids=torch.tensor(reports[0]["ids"]))          # rank 0's batch alone would move it otherwise
    alone = [router.take_load() for router in routers]
    assert any(not torch.equal(bias_sign_step(a), bias_sign_step(t)) for a, t in zip(alone, totals))
    for i, (router, load_E) in enumerate(zip(routers, totals)):
        expected = 0.01 * bias_sign_step(load_E)
        for r in reports:
            before, after = torch.tensor(r["before"][i]), torch.tensor(r["after"][i])
            assert torch.equal(before, router.expert_bias_E), "the bias starts from HF's"
            assert torch.allclose(after - before, expected, atol=1e-7), (i, after - before, expected)
        assert expected.abs().sum() > 0


TRAINER_RUNS = [(1, 2), (2, 1)]   # (ZeRO stage, ep_size) of test_hf_trainer_with_deepspeed_under_torchrun


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """One torchrun on 2 processes for the HF Trainer tests: the resume worker's two Trainers, then
    hf_trainer_worker's runs for TRAINER_RUNS, one after another in the same processes (their start, importing
    transformers and DeepSpeed, is most of each run's time). {"resume" or (stage, ep_size): its output folder}."""
    import subprocess

    from helpers.workers import hf_trainer_resume_worker as worker
    folders = {key: tmp_path_factory.mktemp("hf_trainer") for key in ["resume", *TRAINER_RUNS]}
    runs = [str(a) for stage, ep_size in TRAINER_RUNS for a in (folders[stage, ep_size], stage, ep_size, 24)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               worker.__file__, str(folders["resume"]), *runs]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folders


def test_hf_trainer_resumes_from_its_deepspeed_checkpoint(trainer_runs):
    """Trainer + DeepSpeed ZeRO-1, ep_size 2 on 2 processes: resuming at step 2 of 4 (from other starting weights)
    ends on the same parameters, experts and Adam state included, as the run that never stopped."""
    finals = [torch.load(trainer_runs["resume"] / f"final{rank}.pt") for rank in (0, 1)]
    for final in finals:
        assert final["first"].keys() == final["resumed"].keys()
        for name, first in final["first"].items():
            assert torch.equal(final["resumed"][name], first), name


@pytest.mark.timeout(400)
def test_hf_trainer_resumes_a_deepspeed_checkpoint_at_another_world_size_as_the_uninterrupted_run(tmp_path):
    """Issue 54 item 4: Trainer + DeepSpeed ZeRO-2 on a swapped Mixtral (ep_size = the world size), saved at step 2 on
    2 processes and resumed with trainer.train(resume_from_checkpoint=...) on 1, and saved on 1 and resumed on 2,
    each from other starting weights: after step 3 every parameter equals the run's that never stopped (the same 8
    sequences per step; Adam's moments, step and the linear LR schedule carried over)."""
    import subprocess

    from helpers.workers import hf_trainer_reshard_worker as worker
    two_to_one, one_to_two = tmp_path / "two_to_one", tmp_path / "one_to_two"
    for world, runs in ((2, [two_to_one, "save"]), (1, [two_to_one, "resume", one_to_two, "save"]),
                        (2, [one_to_two, "resume"])):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                   worker.__file__, *map(str, runs)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for folder in (two_to_one, one_to_two):
        want, got = torch.load(folder / "saved.pt"), torch.load(folder / "resumed.pt")
        assert got["step"] == want["step"] == 3 and got["lr"] == want["lr"], folder.name
        assert got["params"].keys() == want["params"].keys()
        assert any(".experts." in name and tensor.shape[0] == 6 for name, tensor in want["params"].items())
        for name, tensor in want["params"].items():
            rel = ((got["params"][name] - tensor).norm() / tensor.norm()).item()
            assert rel < 1e-4, (folder.name, name, rel)


# errors, in this process: they are raised before DeepSpeed starts anything


def test_a_moe_section_next_to_an_enabled_autoep_section_is_an_error():
    """AutoEP would look for the blocks ours replaced and fail with "no MoE layers detected"; say why first."""
    import moe_plugin.integrations.deepspeed as dsi
    autoep = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    config = {**BASE, "moe": {"backend": "tutel", "ep_size": 2}, "expert_parallel": autoep}
    with pytest.raises(ValueError, match=r"\"moe\" section .* enabled \"expert_parallel\" section .* keep one"):
        dsi.initialize(model=build_model("mixtral", seed=0), config=config)
    model = build_model("mixtral", seed=0)    # AutoEP switched off: ours swaps as usual (checked up to DeepSpeed)
    with pytest.raises(ValueError, match="zero_optimization.zero_quantized_gradients=True is not supported"):
        dsi.initialize(model=model, config={**config, "expert_parallel": {**autoep, "enabled": False},
                                            "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})


def test_a_section_on_a_model_without_a_recognised_moe_block_is_an_error():
    import transformers

    import moe_plugin.integrations.deepspeed as dsi
    config = {**BASE, "moe": {"backend": "tutel", "ep_size": 2}}
    looked_for = (r"has no MoE block the adapter recognises: it looked for deepspeed.moe.layer.MoE layers and for "
                  r"the sparse-MoE blocks of the Hugging Face families mixtral, qwen2_moe, qwen3_moe, olmoe, "
                  r"deepseek_v3")
    with pytest.raises(ValueError, match=rf"\(Sequential, no Hugging Face config\) {looked_for}"):
        dsi.initialize(model=nn.Sequential(nn.Linear(4, 4)), config=config)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=rf"\(LlamaForCausalLM, model_type='llama'\) {looked_for}"):
        dsi.initialize(model=llama, config=config)


@pytest.mark.parametrize("key, value, model_value", [("num_experts", 8, 6), ("top_k", 2, 3), ("router", "sigmoid",
                                                     "'softmax'")])
def test_section_keys_the_hf_config_fixes_must_agree_with_it(key, value, model_value):
    import moe_plugin.integrations.deepspeed as dsi
    model = build_model("mixtral", seed=0)
    with pytest.raises(ValueError, match=rf"\"moe.{key}\"={value!r} contradicts the mixtral model's Hugging Face "
                                         rf"config \({key}={model_value}\)"):
        dsi.initialize(model=model, config={**BASE, "moe": {"backend": "tutel", key: value}})
    assert not any(isinstance(m, nn.Module) and type(m).__name__ == "DeepSpeedHFMoEBlock" for m in model.modules())


def test_backend_deepspeed_zero_3_and_bad_values_on_an_hf_model_fail_clearly():
    import moe_plugin.integrations.deepspeed as dsi
    model = build_model("qwen3_moe", seed=0)
    with pytest.raises(ValueError, match=r"\"moe.backend\"='deepspeed' needs deepspeed.moe.layer.MoE layers; the "
                                         r"qwen3_moe model's Hugging Face MoE blocks run on backend \"tutel\""):
        dsi.initialize(model=model, config={**BASE, "moe": {"backend": "deepspeed"}})
    with pytest.raises(ValueError, match=r"zero_optimization.zero_hpz_partition_size=2 is not supported with MoE "
                                         r"layers at zero_optimization.stage 3"):
        dsi.initialize(model=model, config={**BASE, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
                                            "moe": {"backend": "tutel"}})
    with pytest.raises(ValueError, match=r"\"moe.ep_size\"=4 is invalid for the qwen3_moe model's 6 experts: must "
                                         r"divide them, one of \[1, 2, 3, 6\]"):
        dsi.initialize(model=model, config={**BASE, "moe": {"backend": "tutel", "ep_size": 4}})
    with pytest.raises(ValueError, match=r"\"moe.capacity_factor\"=-1 is invalid"):
        dsi.initialize(model=model, config={**BASE, "moe": {"backend": "tutel", "capacity_factor": -1}})


def test_a_model_swapped_before_initialize_must_match_the_section():
    """initialize makes the plain blocks DeepSpeed's (use_deepspeed_blocks), then swap_moe_layers checks them."""
    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.hf import use_deepspeed_blocks
    from moe_plugin.integrations.transformers import swap_moe_blocks
    model = use_deepspeed_blocks(swap_moe_blocks(build_model("olmoe", seed=0), capacity_factor=1.5))
    same, replaced = dsi.swap_moe_layers(model, {"backend": "tutel", "top_k": 3, "capacity_factor": 1.5})
    assert same is model and not replaced
    with pytest.raises(ValueError, match=r"sets capacity_factor=2.0, but block 'model.layers.0.mlp', swapped before "
                                         r"initialize with capacity_factor=1.5"):
        dsi.swap_moe_layers(model, {"backend": "tutel", "capacity_factor": 2.0})
    with pytest.raises(ValueError, match=r"\"moe.top_k\"=2 contradicts block 'model.layers.0.mlp'"):
        dsi.swap_moe_layers(model, {"backend": "tutel", "top_k": 2})
    with pytest.raises(ValueError, match=r"\"moe.backend\"='deepspeed', but block 'model.layers.0.mlp' is "
                                         r"moe_plugin's layer"):
        dsi.swap_moe_layers(model, {"backend": "deepspeed"})


@pytest.mark.parametrize("section, capacity", [
    ({}, (0.0, None)), ({"drop_tokens": False, "capacity_factor": 2.0}, (0.0, 0.0)),
    ({"capacity_factor": 0.5}, (0.5, 0.5)), ({"drop_tokens": True}, (1.0, 1.0)),
    ({"capacity_factor": 0.5, "eval_capacity_factor": 2.0}, (0.5, 2.0))])
def test_capacity_keys_map_as_for_native_layers_and_drop_tokens(section, capacity):
    """HF models stay dropless unless the section asks for a capacity (DeepSpeed's drop_tokens semantics)."""
    from moe_plugin.integrations.deepspeed.hf import check_section_for_model
    from moe_plugin.integrations.transformers import swap_moe_blocks
    model = build_model("mixtral", seed=0)
    config = check_section_for_model(model, {"backend": "tutel", "min_capacity": 0, **section})
    assert (config.capacity_factor, config.eval_capacity_factor) == capacity
    swapped = swap_moe_blocks(model, capacity_factor=config.capacity_factor, min_capacity=0)
    swapped(tokens(seed=1, batch=4, length=17))
    dropped = [m.moe.stats["dropped_fraction"] for m in swapped.modules() if hasattr(m, "moe")]
    if capacity[0] != 1.0:   # at 1.0 an expert may or may not overflow
        assert all(d > 0 for d in dropped) if capacity[0] == 0.5 else all(d == 0 for d in dropped), dropped


def test_swapped_blocks_are_deepspeed_moe_layers_with_per_expert_state_names():
    """The engine's view of the blocks DeepSpeed's paths make (swapped with block_class=DeepSpeedHFMoEBlock, or
    plain blocks turned by use_deepspeed_blocks): a deepspeed.moe.layer.MoE whose experts carry its flags, one state
    entry per local expert and no other key holding "expert"; loading maps the names back."""
    from deepspeed.moe.layer import MoE as NativeMoE
    from deepspeed.moe.utils import is_moe_param

    from moe_plugin.integrations.deepspeed.hf import DeepSpeedHFMoEBlock, use_deepspeed_blocks
    from moe_plugin.integrations.transformers import swap_moe_blocks
    model = swap_moe_blocks(build_model("deepseek_v3", seed=0), block_class=DeepSpeedHFMoEBlock)
    block = model.model.layers[1].mlp
    assert isinstance(block, NativeMoE) and (block.num_experts, block.num_local_experts, block.ep_size) == (8, 8, 1)
    assert {n for n, p in block.named_parameters() if is_moe_param(p)} == {"moe.experts.w1_EDH", "moe.experts.w2_EHD"}
    assert all(p.group_name == "ep_size_1" for p in block.moe.experts.parameters())
    state = block.state_dict()
    per_expert = [k for k in state if k.startswith("deepspeed_moe.experts.deepspeed_experts.")]
    assert sorted(per_expert) == sorted(f"deepspeed_moe.experts.deepspeed_experts.{i}.{n}" for i in range(8)
                                        for n in ("w1_DH", "w2_HD"))
    assert not [k for k in state if "expert" in k and k not in per_expert], list(state)
    assert torch.equal(state["deepspeed_moe.experts.deepspeed_experts.5.w2_HD"], block.moe.experts.w2_EHD[5])
    assert torch.equal(state["moe.router.Expert_bias_E"], block.moe.router.expert_bias_E)
    other = use_deepspeed_blocks(swap_moe_blocks(build_model("deepseek_v3", seed=1))).model.layers[1].mlp
    assert isinstance(other, DeepSpeedHFMoEBlock)
    assert all(p.group_name == "ep_size_1" and not p.allreduce for p in other.moe.experts.parameters())
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.moe.state_dict().values(), block.moe.state_dict().values()))


@pytest.mark.parametrize("stage, ep_size", TRAINER_RUNS)
def test_hf_trainer_with_deepspeed_under_torchrun(stage, ep_size, trainer_runs):
    """The README recipe: swap_moe_blocks(model, ep_size=N), transformers.Trainer with TrainingArguments(deepspeed=...)
    on 2 gloo processes. The engine runs the blocks as MoE; the first step equals one process's SGD step on both
    ranks' batches (experts reduced over the expert-data group only, the rest over all ranks); the loss falls;
    with ep_size 1, plain transformers loads trainer.save_model's folder as the trained model."""
    from helpers.workers import hf_trainer_worker as worker
    tmp_path = trainer_runs[stage, ep_size]
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["has_moe_layers"] and result["blocks"] == ["DeepSpeedHFMoEBlock"], result
        assert result["zero_stage"] == stage and result["local_experts"] == [6 // ep_size], result
        losses = result["losses"]
        assert len(losses) == 24 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    if ep_size == 1:
        assert results[0]["reload_error"] is not None and results[0]["reload_error"] < 1e-5, results[0]
    reference = worker.build_model()
    batch = torch.cat([torch.load(tmp_path / f"batch{rank}.pt") for rank in (0, 1)])
    reference(input_ids=batch, labels=batch).loss.backward()
    step1 = torch.load(tmp_path / "step1.pt")
    for name, param in reference.named_parameters():
        update = 0.5 * param.grad
        error = ((step1[name] - (param - update)).abs().max() - 4 * EPS32 * param.abs().max()).clamp(min=0)
        assert error <= 1e-4 * update.abs().max(), f"{name}: {error} off one process's step"
    params = [torch.load(tmp_path / f"params{rank}.pt") for rank in (0, 1)]
    for name in params[0]:
        expert = ".moe.experts." in name
        same = torch.equal(params[0][name], params[1][name])
        assert same if (not expert or ep_size == 1) else not same, f"{name}: equal across ranks is {same}"
