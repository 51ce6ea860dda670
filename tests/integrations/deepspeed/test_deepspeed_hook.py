"""The "moe" section wherever DeepSpeed starts: moe_plugin_deepspeed_hook.pth (installed by setup.py) wraps
deepspeed.initialize when deepspeed is first imported, so HF Trainer, Accelerate and plain scripts that call it
get the section applied (or our error); MOE_PLUGIN_DEEPSPEED_HOOK=0 turns it off; enable() is idempotent.

What this module tests (moved here from the README):

Tested (tests/integrations/deepspeed/test_deepspeed_hook.py): the installed `.pth` registers the finder without importing
torch or moe_plugin, `import deepspeed` enables the hook, the off switch leaves nothing registered; `enable()`
twice wraps once; routing by every way DeepSpeed reads a config; bad sections give our errors through plain
`deepspeed.initialize`; on 2 gloo ranks a plain `--deepspeed_config` script of native MoE layers (ep_size 2,
ZeRO-1) gives the losses of an explicit `initialize` and, to 1e-5, of DeepSpeed's native layer with the hook
off; under `torchrun` an unchanged HF Trainer script and an Accelerate script (`DeepSpeedPlugin(hf_ds_config=
path)`, a torch Adam made before `prepare`), given only the JSON path (ZeRO-1, ep_size 2), swap the Mixtral
blocks and give the losses of one process training HF's own model on both ranks' batches (rtol 1e-5).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from moe_plugin import MoELayer

pytest.importorskip("deepspeed")
from helpers.launch import run_workers

REINSTALL = "moe_plugin_deepspeed_hook.pth is not installed: run `pip install -e .` (or `pip install .`) again"
PROBE = """
import importlib.util, json, sys
start = {"hook": [type(f).__name__ for f in sys.meta_path].count("DeepSpeedImportHook"),
         "imported": sorted(m for m in ("torch", "moe_plugin", "deepspeed", "moe_plugin_deepspeed_hook")
                            if m in sys.modules)}
importlib.util.find_spec("deepspeed")   # transformers' is_deepspeed_available looks it up without importing it
import deepspeed
print(json.dumps({**start, "enabled": hasattr(deepspeed.initialize, "_moe_plugin_original"),
                  "hook_after": [type(f).__name__ for f in sys.meta_path].count("DeepSpeedImportHook")}))
"""


def require_installed_hook():
    assert importlib.util.find_spec("moe_plugin_deepspeed_hook") is not None, REINSTALL


@pytest.fixture
def hook_state():
    """enable()/disable() in this process, put back as they were."""
    import deepspeed

    from deepspeed.utils import zero_to_fp32

    from moe_plugin.integrations.deepspeed import hook
    before = deepspeed.initialize, zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint
    yield hook
    deepspeed.initialize, zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint = before


@pytest.mark.parametrize("switch", [None, "0"])
def test_the_installed_pth_hooks_deepspeed_when_first_imported_and_can_be_turned_off(switch):
    require_installed_hook()
    env = {k: v for k, v in os.environ.items() if k != "MOE_PLUGIN_DEEPSPEED_HOOK"}
    if switch is not None:
        env["MOE_PLUGIN_DEEPSPEED_HOOK"] = switch
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"}, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["imported"] == [], probe    # the start imports neither torch, moe_plugin nor the hook's module
    on = switch is None
    assert probe == {"hook": int(on), "imported": [], "enabled": on, "hook_after": 0}, probe


def test_enable_is_idempotent_and_disable_restores_deepspeed_s_initialize(hook_state):
    """Also DeepSpeed's zero_to_fp32 consolidation, which enable() makes expert-aware (consolidate.py)."""
    import deepspeed
    from deepspeed.utils import zero_to_fp32

    from moe_plugin.integrations.deepspeed import enable
    hook_state.disable()
    original = deepspeed.initialize
    consolidate = zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint
    assert not hook_state.is_enabled() and not hasattr(original, "_moe_plugin_original")
    assert not hasattr(consolidate, "_moe_plugin_original")
    enable()
    wrapped = deepspeed.initialize
    wrapped_consolidate = zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint
    enable()
    assert deepspeed.initialize is wrapped and wrapped._moe_plugin_original is original
    assert zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint is wrapped_consolidate
    assert wrapped_consolidate._moe_plugin_original is consolidate
    hook_state.disable()
    assert deepspeed.initialize is original and zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint is consolidate


def test_calls_are_routed_by_their_config_and_moe_plugin_s_own_calls_pass_through(hook_state, tmp_path, monkeypatch):
    """A "moe" section in config, config_params, a JSON path or args.deepspeed_config goes to moe_plugin's
    initialize with the caller's arguments; other calls, and calls made from moe_plugin's modules, to DeepSpeed's."""
    import deepspeed

    import moe_plugin.integrations.deepspeed as dsi
    calls = []

    def deepspeed_initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                             lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None,
                             collate_fn=None, config=None, mesh_param=None, config_params=None):
        calls.append(("deepspeed", model, config, config_params, args))
        return "engine"

    hook_state.disable()
    monkeypatch.setattr(deepspeed, "initialize", deepspeed_initialize)
    monkeypatch.setattr(dsi, "initialize", lambda *a, **kw: calls.append(("moe_plugin", a, kw)) or "ours")
    hook_state.enable()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "moe": {"backend": "tutel"}}))
    plain = {"train_batch_size": 2}
    model = torch.nn.Linear(2, 2)

    assert deepspeed.initialize(model=model, config=plain) == "engine"
    assert deepspeed.initialize(model=model, config_params={**plain, "moe": {"backend": "tutel"}}) == "ours"
    assert deepspeed.initialize(None, model, config=str(path)) == "ours"
    cli = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    assert deepspeed.initialize(args=cli, model=model) == "ours"
    assert calls[0] == ("deepspeed", model, plain, None, None)
    assert [c[0] for c in calls] == ["deepspeed", "moe_plugin", "moe_plugin", "moe_plugin"]
    assert calls[2][1] == (None, model) and calls[2][2] == {"config": str(path)}
    assert calls[3][2] == {"args": cli, "model": model}

    swapped = torch.nn.Sequential(torch.nn.Linear(4, 4), MoELayer(model_dim=4, hidden_size=6, num_experts=2))
    assert deepspeed.initialize(model=swapped, config=plain) == "ours"   # no section, but moe_plugin's layers
    assert calls[-1] == ("moe_plugin", (), {"model": swapped, "config": plain})
    calls.clear()

    inside = types.ModuleType("moe_plugin.integrations.deepspeed.somewhere")   # as moe_plugin's initialize calls
    exec("def call(deepspeed, **kw):\n    return deepspeed.initialize(**kw)", inside.__dict__)
    assert inside.call(deepspeed, model=model, config=str(path)) == "engine"
    assert inside.call(deepspeed, model=swapped, config=plain) == "engine"
    assert calls == [("deepspeed", model, str(path), None, None), ("deepspeed", swapped, plain, None, None)]


@pytest.mark.parametrize("section, match", [({"backend": "tutl"}, r"moe\.backend.*'tutl'"),
                                            ({"backend": "tutel", "top_k": 0}, r"moe\.top_k.*0"),
                                            ({"backend": "tutel", "topk": 2}, r"no key 'topk'.*did you mean 'top_k'"),
                                            ({"backend": "tutel", "capacity_factor": 0},
                                             r'"moe\.capacity_factor"=0 .*> 0; for dropless.*"moe\.drop_tokens": false'),
                                            ({"backend": "tutel", "eval_capacity_factor": 0.0},
                                             r'"moe\.eval_capacity_factor"=0\.0 .*"moe\.drop_tokens": false')])
def test_a_bad_section_fails_with_moe_plugin_s_error_through_plain_deepspeed_initialize(hook_state, section, match):
    import deepspeed
    hook_state.enable()
    with pytest.raises(ValueError, match=match) as error:
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 2, "moe": section})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("key", ["MoE", "MOE", "Moe", "moe_config", "moe-section", "mixture_of_experts"])
def test_a_near_miss_of_the_moe_key_is_refused_naming_moe(hook_state, key):
    """DeepSpeed ignores unknown top-level keys: a section under a near miss of "moe" would be dropped silently."""
    import deepspeed
    hook_state.enable()
    with pytest.raises(ValueError, match=rf"top-level key '{key}', which DeepSpeed ignores.*rename '{key}' to \"moe\"$"):
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 2, key: {"backend": "tutel"}})


# a plain script on 2 gloo processes: deepspeed.initialize(args=--deepspeed_config JSON) on a native-MoE model

SECTION = {"backend": "tutel", "num_experts": 4, "ep_size": 2, "top_k": 2, "capacity_factor": 1.25, "min_capacity": 0}
DS_CONFIG = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
             "zero_optimization": {"stage": 1}, "moe": SECTION}


def plain_script_worker(rank, world, path):
    import logging

    import deepspeed
    from deepspeed.moe.layer import MoE as NativeMoE
    from deepspeed.utils import logger

    from moe_plugin.integrations.deepspeed import MoE, hook, initialize
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, synthetic_batch
    from helpers.deepspeed import train
    enabled_at_start = hook.is_enabled()   # by the .pth: nothing in this process called enable()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    generator = torch.Generator().manual_seed(rank)
    batches = [synthetic_batch(generator, 8, 32, 64) for _ in range(4)]

    def run(start):
        torch.manual_seed(0)
        model = MoETransformerLM(SECTION, seed=0)
        engine = start(args=argparse.Namespace(deepspeed_config=path, local_rank=rank), model=model,
                       model_parameters=model.parameters())[0]
        losses = train(engine, batches)
        classes = {f"{type(m).__module__}.{type(m).__name__}" for m in engine.module.modules() if isinstance(m, NativeMoE)}
        return sorted(classes), losses

    hooked = run(deepspeed.initialize)
    explicit = run(initialize)
    hook.disable()   # DeepSpeed's own initialize ignores the section: its native layer is the reference
    native = run(deepspeed.initialize)
    hook.enable()
    return {"enabled_at_start": enabled_at_start, "hooked": hooked, "explicit": explicit, "native": native,
            "classes": [f"{c.__module__}.{c.__name__}" for c in (MoE, NativeMoE)]}


@pytest.mark.slow
def test_a_plain_script_s_deepspeed_initialize_applies_the_section(tmp_path):
    """deepspeed.initialize(args) with --deepspeed_config pointing at a JSON with the section swaps the native
    layers for moe_plugin's (ep_size 2 over 2 ranks, ZeRO-1): the losses equal moe_plugin's explicit initialize
    and, within fp32 tolerance, DeepSpeed's native layer under the same config with the hook off."""
    require_installed_hook()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_CONFIG))
    for result in run_workers(plain_script_worker, 2, str(path), timeout=600):
        assert result["enabled_at_start"]
        assert result["hooked"][1] == result["explicit"][1]
        (hooked_classes, hooked), (native_classes, native) = result["hooked"], result["native"]
        assert [hooked_classes, native_classes] == [[name] for name in result["classes"]], result
        assert torch.allclose(torch.tensor(hooked), torch.tensor(native), rtol=1e-5, atol=0), (hooked, native)


# HF Trainer and Accelerate under torchrun (2 gloo ranks): the scripts name only the JSON's path

HOST_CONFIGS = {
    # HF Trainer's own AdamW (weight decay 0) and a torch Adam the script made from model.parameters() before
    # accelerator.prepare: initialize remaps them and gives the expert parameters groups of their own (ZeRO-1)
    "trainer": {"zero_optimization": {"stage": 1}},
    "accelerate": {"zero_optimization": {"stage": 1}},
}


@pytest.mark.slow
@pytest.mark.parametrize("host", ["trainer", "accelerate"])
def test_hf_trainer_and_accelerate_apply_the_section_of_the_json_they_are_given(host, tmp_path):
    """transformers.Trainer(TrainingArguments(deepspeed=path)) and Accelerator(DeepSpeedPlugin(hf_ds_config=path))
    on an unswapped Mixtral: the blocks are swapped (ep_size 2: each rank holds other experts), DeepSpeed runs them
    as MoE layers, and the losses equal one process training HF's own model on both ranks' batches."""
    require_installed_hook()
    from helpers.workers import hook_worker as worker
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": worker.BATCH, "gradient_accumulation_steps": 1,
                                "gradient_clipping": 0.0, **HOST_CONFIGS[host],
                                "moe": {"backend": "tutel", "ep_size": 2}}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               worker.__file__, str(tmp_path), str(path), host, "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["blocks"] == ["DeepSpeedHFMoEBlock"] and result["has_moe_layers"], result
    assert not result["adapter_before"] and result["experts_differ"], result
    assert len(result["losses"]) == 4, result
    assert torch.allclose(torch.tensor(result["losses"]), torch.tensor(result["reference"]), rtol=1e-5, atol=0), result
