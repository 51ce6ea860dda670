"""ZeRO stage 3 (gloo, 2 and 4 processes): swapped HF blocks and moe_plugin's native-API layer train with the
losses of HF's own blocks / ZeRO-1 under the same config and of one process; ranks routing to disjoint experts or
to none do not hang; expert parameters are split over their expert-data-parallel group (ep_size 2); checkpoints
round-trip and consolidate; HF Trainer with a stage-3 JSON trains and saves a folder plain transformers loads.

What this module tests (moved here from the README):

The tests set `"stage3_param_persistence_threshold": 0` so that every parameter is really partitioned. By default
DeepSpeed keeps parameters under 1e5 elements whole on every rank, and none of the tiny test models' parameters
would be split.

Tested (tests/integrations/deepspeed/test_deepspeed_zero3.py, gloo):
- Tiny Mixtral on 2 ranks (dropless). These give the same per-step losses as HF's own blocks under plain
  `deepspeed.initialize` with the same ZeRO-3 config, and as one process doing SGD on both ranks' batches:
  - blocks swapped with `swap_moe_blocks` (ZeRO-3 through `initialize`);
  - blocks swapped by the "moe" section;
  - fixed capacity (capacity_factor 1.0): the same losses as ZeRO-1;
  - built by HF under `deepspeed.zero.Init`, section at ep_size 2: the same losses as HF's own blocks built that way.
- The native-API layer on 2 ranks, with the router sending rank r's tokens only to expert r (experts 2 and 3 get no
  token). There is no hang, and ZeRO-3's losses equal ZeRO-1's in each of these cases:
  - dropless and fixed capacity;
  - ep_size 1 and 2;
  - a model built under `deepspeed.zero.Init` (ep_size 1).
- 4 ranks, native demo model, ep_size 2:
  - expert parameters are partitioned over their expert-data-parallel group of 2 (each rank holds half of its
    experts), dense parameters over all 4;
  - losses equal ZeRO-1's;
  - the first step's expert gradients (`safe_get_full_grad`) equal one process's on all ranks' batches.
- Checkpoints (2 ranks, Adam):
  - `save_checkpoint` / `load_checkpoint` round-trip at ep_size 1 and 2: same logits, and training goes on with
    the same losses;
  - at ep_size 1 and 2, DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` (and moe_plugin's command line,
    safetensors) give a state dict that loads strictly into a swapped model in one process; through
    `hf_state_dict` it loads into the unswapped HF model, and through `export_hf` into a folder plain
    `from_pretrained` loads (all logits = the engine's).
- Consolidation on 4 ranks (native demo model, ep_size 2: each expert split over an expert-data group of 2, the
  experts over 2 expert-parallel ranks): the one-process model (ep_size 1) loading DeepSpeed's consolidated state
  dict gives the engine's logits. Hidden slices (ep_size 4 over 2 gated experts with biases, one process): the
  per-rank tensors come back as the whole experts.
- HF Trainer under torchrun (2 ranks, stage-3 JSON with the section; a model swapped beforehand, and one swapped by
  the section at ep_size 2): same losses as HF's own blocks under the same Trainer config; `save_model`'s folder
  loads with plain `from_pretrained` as HF's trained model (at ep_size 2: every expert).
- Bad input: a stage-3 config with `zero_optimization.zero_hpz_partition_size` > 1,
  `zero_optimization.zero_quantized_gradients: true` or `sequence_parallel_size` > 1 (or an mpu with sequence
  parallelism) fails in `initialize` with an error naming the key. DeepSpeed's constrained ZeRO-3 refuses these
  for expert placement. The check runs before DeepSpeed starts.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
from helpers.compare import relative_error
from helpers.hf import build_model, needs_transformers, save_and_resume, tokens
from helpers.launch import run_workers

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5   # fp32, relative
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0}   # DeepSpeed clips at 1.0 by default; the one-process reference does not clip


def config(stage, lr, moe=None):
    out = {**BASE, "optimizer": {"type": "SGD", "params": {"lr": lr}}, "zero_optimization": zero(stage)}
    return out if moe is None else {**out, "moe": moe}


def zero(stage):
    """ZeRO at stage; at 3 every parameter partitioned (by default DeepSpeed keeps those under 1e5 elements whole)."""
    return {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}


def setup_worker(rank, world):
    import logging

    import deepspeed
    from deepspeed.utils import logger
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")


def hf_worker(rank, world, steps):
    """Tiny Mixtral under ZeRO-3: HF's own blocks (plain deepspeed.initialize), blocks swapped by swap_moe_blocks
    and by the "moe" section (our initialize; also with recompute "experts"), one process with SGD on both ranks' batches; with a fixed capacity,
    the section's model under ZeRO-3 and ZeRO-1; built under deepspeed.zero.Init as HF does at stage 3, HF's blocks,
    the section's at ep_size 2 and blocks swapped by hand (swap_moe_blocks gathers the partitioned weights)."""
    setup_worker(rank, world)
    import deepspeed

    from moe_plugin.integrations.deepspeed import initialize
    from moe_plugin.integrations.transformers import swap_moe_blocks
    lr = 0.3
    batches = [[tokens(seed=100 * r + i) for r in range(world)] for i in range(steps)]

    def train(engine):
        losses = []
        for i in range(steps):
            loss = engine(input_ids=batches[i][rank], labels=batches[i][rank]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    reference = build_model("mixtral", seed=3)
    one_process = []
    for i in range(steps):
        with torch.no_grad():   # this rank's loss, as the engine reports it
            one_process.append(reference(input_ids=batches[i][rank], labels=batches[i][rank]).loss.item())
        ids = torch.cat(batches[i])
        reference.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= lr * p.grad
    report = {"one process": one_process}
    report["hf"] = train(deepspeed.initialize(model=build_model("mixtral", seed=3), config=config(3, lr))[0])
    swapped = swap_moe_blocks(build_model("mixtral", seed=3))
    report["swapped"] = train(initialize(model=swapped, config=config(3, lr))[0])
    report["section"] = train(initialize(model=build_model("mixtral", seed=3),
                                         config=config(3, lr, {"backend": "tutel"}))[0])
    report["section recompute"] = train(initialize(model=build_model("mixtral", seed=3),
                                                   config=config(3, lr, {"backend": "tutel",
                                                                         "recompute": "experts"}))[0])
    capacity = {"backend": "tutel", "capacity_factor": 1.0}
    for stage in (3, 1):
        engine = initialize(model=build_model("mixtral", seed=3), config=config(stage, lr, capacity))[0]
        report[f"capacity zero{stage}"] = train(engine)
    from transformers.integrations import HfDeepSpeedConfig
    zero3 = HfDeepSpeedConfig(config(3, lr))   # while it lives, HF builds models under deepspeed.zero.Init
    report["zero.Init hf"] = train(deepspeed.initialize(model=build_model("mixtral", seed=3), config=config(3, lr))[0])
    report["zero.Init section ep 2"] = train(initialize(model=build_model("mixtral", seed=3),
                                                        config=config(3, lr, {"backend": "tutel", "ep_size": 2}))[0])
    report["zero.Init swapped"] = train(initialize(model=swap_moe_blocks(build_model("mixtral", seed=3)),
                                                   config=config(3, lr))[0])
    del zero3
    return report


@needs_transformers
def test_hf_blocks_under_zero3_equal_hf_own_blocks_and_one_process():
    """Also for a model HF built under deepspeed.zero.Init (the section swaps its gathered blocks, ep_size 2, and
    swap_moe_blocks by hand does the same)."""
    for report in run_workers(hf_worker, 2, 3, timeout=600):
        for name in ("hf", "swapped", "section", "section recompute"):
            assert all(relative_error(a, b) < TOLERANCE for a, b in zip(report[name], report["one process"])), report
        assert all(relative_error(a, b) < TOLERANCE
                   for a, b in zip(report["capacity zero3"], report["capacity zero1"])), report
        assert report["capacity zero3"] != report["section"], report   # the capacity dropped tokens
        assert report["zero.Init hf"] != report["hf"], report   # HF draws other weights under zero.Init
        for name in ("zero.Init section ep 2", "zero.Init swapped"):
            assert all(relative_error(a, b) < TOLERANCE for a, b in zip(report[name], report["zero.Init hf"])), report


class Routed(nn.Module):
    """x -> Linear (identity at first) -> moe_plugin's native-API MoE (4 experts, top-1) -> y; the router sends every
    token of rank r to expert r. (DeepSpeed's leaf-module hook needs an input that requires grad: hence the Linear.)"""

    def __init__(self, ep_size, drop_tokens, D=8, H=12, E=4):
        super().__init__()
        import moe_plugin.integrations.deepspeed as dsi
        import deepspeed
        self.pre = nn.Linear(D, D)
        expert = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
        self.moe = dsi.MoE(D, expert, num_experts=E, ep_size=ep_size, k=1, capacity_factor=1.0, min_capacity=0,
                           drop_tokens=drop_tokens, use_rts=False)
        torch.manual_seed(1)
        layer = self.moe.deepspeed_moe
        # built under deepspeed.zero.Init the parameters are partitioned already: gathered to set them
        with deepspeed.zero.GatheredParameters(list(self.parameters()), modifier_rank=0), torch.no_grad():
            self.pre.weight.copy_(torch.eye(D))
            self.pre.bias.zero_()
            layer.router.weight_ED.copy_(torch.eye(E, D) * 20)
            for tensor in layer.experts.parameters():   # distinct experts (at ep 2 each rank draws its own two)
                tensor.normal_(0, 0.3)

    def forward(self, x):
        return self.moe(self.pre(x))[0]


def routed_batch(rank, step, T=9, D=8):
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(10 * step + rank)) * 0.3
    x[:, rank] += 2.0   # rank r's tokens to expert r: disjoint experts per rank, experts 2 and 3 get none
    return x, torch.randn(T, D, generator=torch.Generator().manual_seed(1000 + 10 * step + rank))


def routed_worker(rank, world, cases):
    setup_worker(rank, world)
    import deepspeed

    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM
    report = {}
    for ep_size, drop_tokens in cases:
        losses = {}
        for stage in (1, 3, "zero.Init"):
            if stage == "zero.Init":
                if ep_size > 1:
                    continue
                with deepspeed.zero.Init(config_dict_or_path=config(3, 0.1)):
                    model = Routed(ep_size, drop_tokens)
            else:
                model = Routed(ep_size, drop_tokens)
            engine = dsi.initialize(model=model, config=config(3 if stage == "zero.Init" else stage, 0.1))[0]
            losses[stage] = []
            for step in range(3):
                x, target = routed_batch(rank, step)
                loss = ((engine(x) - target) ** 2).mean()
                engine.backward(loss)
                engine.step()
                losses[stage].append(loss.item())
            if stage == 3:
                losses["class"] = type(engine.module.moe).__name__
                losses["counts"] = engine.module.moe.deepspeed_moe.exp_counts.tolist()
        report[(ep_size, drop_tokens)] = losses
    errors = []
    with deepspeed.zero.Init(config_dict_or_path=config(3, 0.1)):
        models = [Routed(2, False), MoETransformerLM({"num_experts": 4})]
    for model, moe in zip(models, [None, {"backend": "tutel"}]):
        try:
            dsi.initialize(model=model, config=config(3, 0.1, moe))
        except ValueError as error:
            errors.append(str(error))
    report["errors"] = errors
    return report


@pytest.mark.parametrize("world, cases", [(2, [(1, False), (1, True), (2, False), (2, True)])])
def test_native_layer_with_disjoint_and_empty_experts_equals_zero1(world, cases):
    """Rank r routes only to expert r (experts 2, 3 get no token): no hang, and ZeRO-3's losses equal ZeRO-1's,
    dropless and with a fixed capacity, ep_size 1 and 2, also when built under deepspeed.zero.Init (ep_size 1);
    under zero.Init, ep_size 2 and DeepSpeed's own layer are refused, naming what to do instead."""
    for rank, report in enumerate(run_workers(routed_worker, world, cases, timeout=300)):
        errors = report.pop("errors")
        for case, losses in report.items():
            assert losses["class"] == "Zero3MoE" and losses["counts"] == [9 if e == rank else 0 for e in range(4)], \
                (case, losses)
            assert all(relative_error(a, b) < TOLERANCE for a, b in zip(losses[3], losses[1])), (case, losses)
            if "zero.Init" in losses:   # built under deepspeed.zero.Init: the same training
                assert losses["zero.Init"] == losses[3], (case, losses)
        assert len(errors) == 2, errors
        assert "with ep_size=2 it must be split over its expert-data-parallel group: build the model outside " \
               "deepspeed.zero.Init" in errors[0], errors
        assert "(deepspeed.moe.layer.MoE) was built under deepspeed.zero.Init" in errors[1], errors


def expert_parallel_worker(rank, world, steps, directory):
    """The native demo model, ep_size 2 (dropless): ZeRO-3 against ZeRO-1 and, for the first step's expert
    gradients, one process on every rank's batch; where ZeRO-3 put each parameter; after training, the ZeRO-3
    engine's checkpoint and its logits on a probe batch (for the consolidation check)."""
    setup_worker(rank, world)
    import torch.distributed as dist
    from deepspeed.utils import groups, safe_get_full_grad

    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss, synthetic_batch
    section = {"backend": "tutel", "num_experts": 4, "ep_size": 2, "top_k": 2, "drop_tokens": False}
    generator = torch.Generator().manual_seed(7)
    batches = [[synthetic_batch(generator, 2, 16, 64) for _ in range(world)] for _ in range(steps)]

    def model(ep_size=2):
        torch.manual_seed(0)
        return MoETransformerLM({**section, "ep_size": ep_size}, seed=0, seq_len=16)

    report = {}
    for stage in (1, 3):
        engine = dsi.initialize(model=model(), config=config(stage, 0.1, section))[0]
        report[stage] = []
        for i in range(steps):
            loss = lm_loss(engine, batches[i][rank])
            engine.backward(loss)
            if stage == 3 and i == 0:
                experts = {n: p for n, p in engine.module.named_parameters() if ".experts." in n}
                report["grads"] = {n: safe_get_full_grad(p) for n, p in experts.items()}
                edp = dist.get_process_group_ranks(groups._get_expert_data_parallel_group("ep_size_2"))
                report["experts placed"] = all(dist.get_process_group_ranks(p.ds_process_group) == edp
                                               and p.ds_tensor.numel() == -(-p.ds_numel // len(edp))
                                               for p in experts.values())
                report["dense placed"] = all(dist.get_world_size(p.ds_process_group) == world
                                             for n, p in engine.module.named_parameters() if n not in experts)
            engine.step()
            report[stage].append(loss.item())
    engine.save_checkpoint(directory, tag="c")
    with torch.no_grad():
        report["probe logits"] = engine(synthetic_batch(torch.Generator().manual_seed(99), 2, 16, 64)[:, :-1]).tolist()
    reference = dsi.swap_moe_layers(model(ep_size=1), {**section, "ep_size": 1})[0]
    ids = torch.cat(batches[0])
    lm_loss(reference, ids).backward()
    local = slice(2 * (rank % 2), 2 * (rank % 2) + 2)   # DeepSpeed's expert groups: consecutive ranks
    report["grad error"] = max(((report["grads"][n] - p.grad[local]).abs().max() / p.grad.abs().max()).item()
                               for n, p in reference.named_parameters() if n in report["grads"])
    del report["grads"]
    return report


def test_expert_parallel_under_zero3_on_four_ranks(tmp_path):
    """4 ranks, ep_size 2: experts split over their expert-data-parallel group of 2, dense parameters over all 4;
    losses equal ZeRO-1's, first-step expert gradients equal one process's; DeepSpeed's zero_to_fp32 (with the
    hook on) merges each expert over its expert-data group and the experts over the expert-parallel ranks: the
    one-process model (ep_size 1) loading its state dict gives the engine's logits."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, synthetic_batch
    reports = run_workers(expert_parallel_worker, 4, 3, str(tmp_path), timeout=600)
    for report in reports:
        assert report["experts placed"] and report["dense placed"], report
        assert all(relative_error(a, b) < TOLERANCE for a, b in zip(report[3], report[1])), report
        assert report["grad error"] < 1e-5, report
    section = {"backend": "tutel", "num_experts": 4, "ep_size": 1, "top_k": 2, "drop_tokens": False}
    one_process = dsi.swap_moe_layers(MoETransformerLM(section, seed=1, seq_len=16), section)[0]
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="c")
    assert state["blocks.0.ffn.moe.deepspeed_moe.experts.w1_EDH"].shape[0] == 4, {k: v.shape for k, v in state.items()}
    one_process.load_state_dict(state)
    with torch.no_grad():
        logits = one_process(synthetic_batch(torch.Generator().manual_seed(99), 2, 16, 64)[:, :-1])
    assert (logits - torch.tensor(reports[0]["probe logits"])).abs().max() < 1e-5 * logits.abs().max()


def test_consolidation_puts_hidden_slices_back_together():
    """ep_size 4 over 2 experts (each rank holds half of one expert's hidden units, gated, with biases): the
    checkpoint's per-rank expert tensors come back as the whole experts a one-process layer draws from the seed."""
    from moe_plugin.config import MoEConfig
    from moe_plugin.experts import Experts
    from moe_plugin.integrations.deepspeed.consolidate import _whole_experts
    config = MoEConfig(model_dim=6, hidden_size=10, num_experts=2, activation="swiglu", bias=True)
    torch.manual_seed(3)
    whole = Experts(config)
    ranks = []
    for ep_rank in range(4):
        torch.manual_seed(3)
        ranks.append(Experts(config, first_expert=ep_rank // 2, local_experts=1, slices=2, slice_index=ep_rank % 2))
    shapes = {"moe.router.weight_ED": torch.Size([2, 6]), "moe.experts.w2_EHD": ranks[0].w2_EHD.shape}
    for name in ("w1_EDH", "b1_EH", "w2_EHD", "b2_ED"):
        merged = _whole_experts(f"moe.experts.{name}", {r: getattr(e, name).detach() for r, e in enumerate(ranks)},
                                shapes)
        assert torch.equal(merged[f"moe.experts.{name}"], getattr(whole, name)), name


def checkpoint_worker(rank, world, directory, ep_size):
    """Tiny Mixtral under ZeRO-3 (Adam): train, save_checkpoint, a fresh engine loads it (same logits, same next
    losses); the logits saved for consolidate()."""
    setup_worker(rank, world)
    import torch.distributed as dist

    from moe_plugin.integrations.deepspeed import initialize
    adam = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": zero(3), "moe": {"backend": "tutel", "ep_size": ep_size}}

    def engine_from(seed):
        return initialize(model=build_model("mixtral", seed=seed), config=copy.deepcopy(adam))[0]

    def step(engine, ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    def logits(engine, ids):
        with torch.no_grad():
            return engine(input_ids=ids).logits

    report, saved, _, _ = save_and_resume(engine_from, step, logits, directory, rank, tokens(seed=50))
    dist.barrier()
    if rank == 0:
        torch.save(saved, os.path.join(directory, "saved_logits.pt"))
    dist.barrier()
    return report


def consolidate(directory):
    """One process, after training: DeepSpeed's zero_to_fp32 state dict (expert-aware once moe_plugin's hook is on)
    -> a swapped model (ep_size 1) -> HF names and export_hf, and the same through moe_plugin's zero_to_fp32 command
    line; the logits of each against the engine's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moe_plugin.integrations.transformers import export_hf, hf_state_dict, swap_moe_blocks
    state = get_fp32_state_dict_from_zero_checkpoint(directory, tag="t")
    swapped = swap_moe_blocks(build_model("mixtral", seed=5))
    swapped.load_state_dict(state)
    hf = build_model("mixtral", seed=6)
    hf.load_state_dict(hf_state_dict(swapped))
    export_hf(swapped, os.path.join(directory, "exported"))
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(directory, "exported"))
    done = subprocess.run([sys.executable, "-m", "moe_plugin.integrations.deepspeed.zero_to_fp32", directory,
                           os.path.join(directory, "fp32"), "-t", "t", "--safe_serialization"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and "Warning: 'moe_plugin" not in done.stderr, done.stderr[-3000:]
    from_command = swap_moe_blocks(build_model("mixtral", seed=7))
    from_command.load_state_dict(load_file(os.path.join(directory, "fp32", "model.safetensors")))
    probe, saved = tokens(seed=50), torch.load(os.path.join(directory, "saved_logits.pt"))
    with torch.no_grad():
        return {name: (model(input_ids=probe).logits - saved).abs().max().item()
                for name, model in (("swapped", swapped), ("hf", hf), ("exported", exported),
                                    ("command line", from_command))}


@needs_transformers
@pytest.mark.parametrize("ep_size", [1, 2])
def test_checkpoints_under_zero3(ep_size, tmp_path):
    """save_checkpoint / load_checkpoint round trip (ep_size 1 and 2, optimizer state included: training goes on
    identically); zero_to_fp32's state dict (every expert at ep_size 2) loads into an unswapped HF model and
    export_hf."""
    for report in run_workers(checkpoint_worker, 2, str(tmp_path), ep_size, timeout=600):
        assert report["fresh differs"] > 1e-3 and report["restored"] < 1e-6, report
        assert report["losses"][0] == report["losses"][1], report
    errors = consolidate(str(tmp_path))
    assert max(errors.values()) < 1e-5, errors


@needs_transformers
def test_hf_trainer_under_zero3_equals_hf_own_blocks_and_save_model_loads(tmp_path):
    """transformers.Trainer, a stage-3 JSON with "moe": {"backend": "tutel"} and a model swapped by swap_moe_blocks,
    under torchrun on 2 gloo ranks, and the same with the section at ep_size 2 (it swaps the blocks): the losses
    of HF's own blocks under the same Trainer config, and save_model's folder
    (stage3_gather_16bit_weights_on_model_save; at ep_size 2 every expert gathered) loads with plain
    from_pretrained as HF's."""
    from helpers.workers import hf_trainer_worker
    from helpers.workers import hf_trainer_zero3_worker as worker
    from transformers import MixtralForCausalLM
    modes = ("ours", "ours_ep2", "hf")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               worker.__file__, str(tmp_path), ",".join(modes), "6"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {mode: [json.loads((tmp_path / mode / f"result{rank}.json").read_text()) for rank in (0, 1)]
               for mode in modes}
    for ours, ours_ep2, hf in zip(results["ours"], results["ours_ep2"], results["hf"]):
        assert ours["blocks"] == ["HFMoEBlock"] == ours_ep2["blocks"] and hf["blocks"] == [], (ours, hf)
        for swapped in (ours, ours_ep2):
            assert len(swapped["losses"]) == 6, swapped
            assert all(relative_error(a, b) < TOLERANCE for a, b in zip(swapped["losses"], hf["losses"])), (swapped, hf)
    probe = torch.stack([row["input_ids"] for row in hf_trainer_worker.dataset(4)])
    with torch.no_grad():
        logits = {mode: MixtralForCausalLM.from_pretrained(tmp_path / mode / "final")(input_ids=probe).logits
                  for mode in modes}
        untrained = hf_trainer_worker.build_model()(input_ids=probe).logits
    for mode in ("ours", "ours_ep2"):
        assert (logits[mode] - logits["hf"]).abs().max() < 1e-4 * (logits["hf"] - untrained).abs().max(), mode
