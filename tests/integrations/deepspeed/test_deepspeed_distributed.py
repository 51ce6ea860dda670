"""DeepSpeed backend on 2 gloo processes: training under ZeRO 0/1/2, equivalence with DeepSpeed's own MoE
layer, checkpoints both ways (the example script under torchrun: docs/deepspeed.md's runnable block, run by
tests/test_docs.py)."""
import os

import pytest
import torch

pytest.importorskip("deepspeed")
from helpers.deepspeed import batches, native_named_grads, setup_worker, stable_topk, train  # noqa: E402
from helpers.launch import run_workers  # noqa: E402

SECTION = {"num_experts": 4, "ep_size": 2, "top_k": 2, "capacity_factor": 1.25, "min_capacity": 0}
TOLERANCE = 1e-5   # fp32; DeepSpeed's gate always computes in fp32


def build_engine(backend, stage, seed, lr=1e-2, batch=8):
    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM
    section = {"backend": backend, **SECTION}
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "moe": section}
    torch.manual_seed(seed)
    engine, _, _, _ = dsi.initialize(model=MoETransformerLM(section, seed=seed), config=config)
    return engine


def train_worker(rank, world, stage):
    setup_worker(rank, world)
    import moe_plugin.integrations.deepspeed as dsi
    engine = build_engine("tutel", stage, seed=0)
    assert all(isinstance(block.ffn.moe, dsi.MoE) for block in engine.module.blocks)
    losses = train(engine, batches(100 + rank, 20))
    # numpy: tensors would travel through shared memory that dies with this process
    return losses, {name: p.detach().numpy().copy() for name, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_training_with_zero_stages(stage):
    (losses0, params0), (losses1, params1) = run_workers(train_worker, 2, stage, timeout=150)
    for losses in (losses0, losses1):
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    experts = [name for name in params0 if ".deepspeed_moe.experts." in name]
    assert len(experts) == 2 * 4   # 2 layers x (w1, b1, w2, b2)
    for name, value in params0.items():
        if name in experts:
            assert (value != params1[name]).any(), f"{name}: ranks hold different experts"
        else:
            assert (value == params1[name]).all(), f"{name}: shared weights must stay identical across ranks"


def equivalence_worker(rank, world, cases):
    setup_worker(rank, world)
    stable_topk()
    from deepspeed.moe.layer import MoE as NativeMoE
    from torch import nn

    import moe_plugin.integrations.deepspeed as dsi
    D, H, E, T = 8, 16, 4, 24
    worst = {}
    for case in cases:
        torch.manual_seed(case["seed"])
        native = NativeMoE(D, nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), num_experts=E,
                           ep_size=case["ep"], k=case["k"], capacity_factor=case["cf"],
                           eval_capacity_factor=case["eval_cf"], min_capacity=case["min_capacity"],
                           drop_tokens=case["drop"], use_rts=False, top2_2nd_expert_sampling=False)
        native.set_deepspeed_parallelism()
        torch.manual_seed(case["seed"] + 1 + rank)   # every expert distinct
        for module in native.deepspeed_moe.experts.deepspeed_experts.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        ours = dsi.swap_moe_layers(nn.ModuleDict({"moe": native}), {"backend": "tutel"})[0]["moe"]
        generator = torch.Generator().manual_seed(case["seed"] * 10 + rank)
        x_TD = torch.randn(T, D, generator=generator)
        upstream_TD = torch.randn(T, D, generator=generator)
        results = []
        for layer in (native, ours):
            layer.train(case["train"])
            x = x_TD.clone().requires_grad_()
            y, l_aux, exp_counts = layer(x)
            ((y * upstream_TD).sum() + 0.1 * l_aux).backward()
            results.append({"y": y.detach(), "l_aux": l_aux.detach(), "exp_counts": exp_counts.float(),
                            "x.grad": x.grad, **native_named_grads(layer)})
        dropped = ours.deepspeed_moe.stats["dropped_fraction"]
        assert results[0].keys() == results[1].keys()
        errors = {key: (results[0][key] - results[1][key]).abs().max().item() for key in results[0]}
        worst[case["name"]] = (max(errors.values()), max(errors, key=errors.get), dropped)
    return worst


CASES = [dict(name=f"k{k} ep{ep} {kind}", k=k, ep=ep, seed=10 * k + ep, **settings)
         for k in (1, 2) for ep in (1, 2) for kind, settings in {
             "drops": dict(cf=0.75, eval_cf=2.0, min_capacity=0, drop=True, train=True),
             "min_capacity": dict(cf=0.1, eval_cf=1.0, min_capacity=3, drop=True, train=True),
             "eval": dict(cf=0.5, eval_cf=0.75, min_capacity=0, drop=True, train=False),
             "dropless": dict(cf=0.5, eval_cf=0.5, min_capacity=0, drop=False, train=True)}.items()]


def test_same_numbers_as_deepspeed_moe():
    """Outputs, l_aux, exp_counts and the gradients of input, gate and every expert tensor, top-1 and top-2,
    ep_size 1 and 2, fixed capacity with drops, min_capacity, eval capacity, dropless."""
    for worst in run_workers(equivalence_worker, 2, CASES, timeout=150):
        for name, (error, where, dropped) in worst.items():
            assert error < TOLERANCE, f"{name}: {where} differs by {error}"
            assert (dropped > 0) == ("dropless" not in name), f"{name}: dropped fraction {dropped}"


def checkpoint_worker(rank, world, directory):
    setup_worker(rank, world)
    import torch.distributed as dist

    def outputs(engine, tokens):
        engine.eval()
        with torch.no_grad():
            y = engine(tokens[:, :-1])
        engine.train()
        return y

    def experts(engine):
        return [p.detach().clone() for n, p in engine.module.named_parameters() if ".experts." in n]

    probe = batches(50 + rank, 1)[0]
    native = build_engine("deepspeed", stage=1, seed=1)
    train(native, batches(rank, 3))
    native.save_checkpoint(directory, tag="native")
    report = {}
    # a native checkpoint into backend tutel: weights (optimizer states are laid out per native parameter)
    tutel = build_engine("tutel", stage=1, seed=2)
    tutel.load_checkpoint(directory, tag="native", load_optimizer_states=False)
    report["native -> tutel"] = (outputs(tutel, probe) - outputs(native, probe)).abs().max().item()
    # tutel -> tutel: every rank's experts and the optimizer state come back, training resumes exactly
    train(tutel, batches(10 + rank, 2))
    tutel.save_checkpoint(directory, tag="tutel")
    saved_experts, saved_outputs = experts(tutel), outputs(tutel, probe)
    resumed = build_engine("tutel", stage=1, seed=3)
    resumed.load_checkpoint(directory, tag="tutel")
    report["experts restored"] = all(torch.equal(a, b) for a, b in zip(experts(resumed), saved_experts))
    report["experts differ from a fresh model"] = not any(
        torch.equal(a, b) for a, b in zip(experts(build_engine("tutel", stage=1, seed=3)), saved_experts))
    more = batches(20 + rank, 2)
    train(resumed, more)
    train(tutel, more)
    report["resumed"] = (outputs(resumed, probe) - outputs(tutel, probe)).abs().max().item()
    # and back: a tutel checkpoint into the native backend
    back = build_engine("deepspeed", stage=1, seed=4)
    back.load_checkpoint(directory, tag="tutel", load_optimizer_states=False)
    report["tutel -> native"] = (outputs(back, probe) - saved_outputs).abs().max().item()
    dist.barrier()
    report["files"] = sorted(os.listdir(os.path.join(directory, "tutel")))
    return report


def test_checkpoints_round_trip_every_rank_and_load_native_ones(tmp_path):
    for report in run_workers(checkpoint_worker, 2, str(tmp_path), timeout=170):
        assert report["native -> tutel"] < TOLERANCE, report
        assert report["tutel -> native"] < TOLERANCE, report
        assert report["experts restored"] and report["experts differ from a fresh model"], report
        assert report["resumed"] == 0.0, report
        expert_files = [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)]
        assert set(expert_files) <= set(report["files"]), report["files"]


def bare_layer_worker(rank, world):
    """{(ep_size, stage, how): the ValueError's message, or "engine"} for a model holding a bare MoELayer."""
    import deepspeed

    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin import MoELayer
    from moe_plugin.integrations.deepspeed import hook
    setup_worker(rank, world)
    out = {}
    for ep_size in (2, 1):
        for stage in (1, 3):
            calls = [("moe_plugin", dsi.initialize)] + [("hooked deepspeed", deepspeed.initialize)] * hook.is_enabled()
            for how, initialize in calls:
                torch.manual_seed(0)
                layer = MoELayer(dict(model_dim=8, hidden_size=16, num_experts=4, top_k=2, ep_size=ep_size))
                model = torch.nn.Sequential(torch.nn.Linear(8, 8), layer, torch.nn.Linear(8, 8))
                config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
                          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
                try:
                    initialize(model=model, config=config)
                    out[f"{ep_size} {stage} {how}"] = "engine"
                except ValueError as error:
                    out[f"{ep_size} {stage} {how}"] = str(error)
    return out


@pytest.mark.slow
def test_an_expert_parallel_layer_deepspeed_would_not_see_as_moe_is_refused():
    """A bare MoELayer at ep_size 2 (not inside a DeepSpeed MoE module) would have its experts taken for replicated
    weights: rank 0's broadcast to every rank, gradients averaged over ranks holding other experts. initialize (and
    the hooked deepspeed.initialize) refuse it by name at ZeRO stages 1 and 3; at ep_size 1 it is a replicated
    layer and trains."""
    for out in run_workers(bare_layer_worker, 2, timeout=200):
        assert any(key.endswith("hooked deepspeed") for key in out) or len(out) == 4, out
        for key, message in out.items():
            if key.startswith("2 "):
                assert "ep_size=2" in message and "1 is an MoELayer" in message, (key, message)
                assert "moe_plugin.integrations.deepspeed.MoE" in message, (key, message)
            else:
                assert message == "engine", (key, message)
