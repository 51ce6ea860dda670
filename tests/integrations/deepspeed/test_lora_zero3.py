"""LoRA inside the layer (moe_plugin.lora.add_lora) on a swapped tiny Mixtral under DeepSpeed ZeRO-3 (2 gloo
processes, every parameter partitioned; ep_size 1 and 2): a few SGD steps give one process's losses on both ranks'
batches and its adapters, and the frozen base does not move. Everything but the adapters is frozen, so no MoE block's
input requires grad (DeepSpeed's leaf-module gradient hook then fired before the layer's backward: zero3.py)."""
import copy
import os

import pytest
import torch

pytest.importorskip("deepspeed")
from helpers.hf import build_model, needs_transformers, tokens
from helpers.launch import run_workers

pytestmark = [pytest.mark.slow, needs_transformers]
STEPS, LR = 3, 0.5


def adapted(ep_size):
    from moe_plugin.integrations.transformers import swap_moe_blocks
    from moe_plugin.lora import add_lora
    model = swap_moe_blocks(build_model("mixtral", seed=3), ep_size=ep_size).requires_grad_(False)   # fine-tuning
    add_lora(model, rank=2, alpha=4.0)
    return model


def lora_zero3_worker(rank, world, ep_size):
    import logging

    import deepspeed
    from deepspeed.utils import logger
    from moe_plugin.integrations.deepspeed import initialize
    from moe_plugin.train.checkpoint import load_full_state_dict
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")

    reference = adapted(1)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if ".lora." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    initial = copy.deepcopy(reference.state_dict())
    batches = [[tokens(seed=100 * r + i) for r in range(world)] for i in range(STEPS)]
    want = []
    for i in range(STEPS):
        with torch.no_grad():
            want.append(reference(input_ids=batches[i][rank], labels=batches[i][rank]).loss.item())
        ids = torch.cat(batches[i])
        reference.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                if p.requires_grad:
                    p -= LR * p.grad

    model = adapted(ep_size)
    load_full_state_dict(model, initial)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = initialize(model=model, config=config)[0]
    got = []
    for i in range(STEPS):
        loss = engine(input_ids=batches[i][rank], labels=batches[i][rank]).loss
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    trained = {}
    for prefix, layer in [(n, m) for n, m in engine.module.named_modules() if hasattr(m, "lora")]:
        with deepspeed.zero.GatheredParameters(list(layer.parameters())):
            layout = engine.module.get_submodule(prefix.rpartition(".experts")[0]).groups.layout \
                if ".experts" in prefix else None
            first, count = layout.first_expert, layout.local_experts
            for name, param in layer.named_parameters():
                trained[f"{prefix}.{name}"] = (param.detach().clone(), first, count)
    final = reference.state_dict()
    adapter_error = max(float((t - final[k][f:f + c]).abs().max() / final[k].abs().max())
                        for k, (t, f, c) in trained.items() if ".lora." in k)
    base_error = max(float((t - initial[k][f:f + c]).abs().max())
                     for k, (t, f, c) in trained.items() if ".lora." not in k)
    moved = min(float((final[k] - initial[k]).abs().max()) for k in trained if ".lora." in k)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return {"loss": loss_error, "adapters": adapter_error, "base": base_error, "moved": moved,
            "count": sum(".lora." in k for k in trained)}


@pytest.mark.parametrize("ep_size", [1, 2])
def test_add_lora_under_zero3_equals_one_process(ep_size):
    for report in run_workers(lora_zero3_worker, 2, ep_size, timeout=400):
        assert report["count"] == 8 and report["moved"] > 1e-3, report
        assert report["loss"] < 1e-5 and report["adapters"] < 1e-5, report
        assert report["base"] == 0.0, report
