"""bf16 training through the hosts: DeepSpeed's "bf16": {"enabled": true} on its CPU accelerator (2 gloo
processes, experts spread over both; native layers and swapped Hugging Face models), and fairseq's MoE FFN cast to bf16 as its --bf16 casts the model
(fairseq 0.12's --bf16 itself needs a TPU). The host casts the model and its activations to bf16 (no
autocast): losses must stay finite and go down."""
import math
import os

import pytest
import torch

from helpers.launch import run_workers

SECTION = {"backend": "tutel", "num_experts": 4, "ep_size": 2, "top_k": 2, "capacity_factor": 1.25,
           "min_capacity": 0}


def start_deepspeed(rank, world):
    """DeepSpeed's process setup on a rank spawned by run_workers (gloo), its logger quiet."""
    import logging

    import deepspeed
    from deepspeed.utils import logger
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")


def deepspeed_bf16_worker(rank, world, stage):
    from deepspeed.accelerator import get_accelerator

    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss, synthetic_batch
    start_deepspeed(rank, world)
    assert get_accelerator().is_bf16_supported(), "DeepSpeed's CPU accelerator says it has no bf16"
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "moe": SECTION}
    torch.manual_seed(0)
    engine, _, _, _ = dsi.initialize(model=MoETransformerLM(SECTION, seed=0), config=config)
    layers = [block.ffn.moe for block in engine.module.blocks]
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = synthetic_batch(generator, 8, 32, 64)
    losses = []
    for _ in range(12):          # the same batch again and again: the loss must fall
        loss = lm_loss(engine, tokens)
        engine.backward(loss + 0.01 * engine.module.l_aux())
        engine.step()
        losses.append(float(loss))
    dtypes = {p.dtype for layer in layers for p in layer.parameters()}
    return losses, [str(d) for d in dtypes]


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_bf16_trains_on_the_cpu_accelerator(stage):
    pytest.importorskip("deepspeed")
    for losses, dtypes in run_workers(deepspeed_bf16_worker, 2, stage, timeout=300):
        assert dtypes == ["torch.bfloat16"], dtypes
        assert all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < 0.8 * losses[0], losses


def deepspeed_bf16_hf_worker(rank, world, stage, families):
    """Per family: the first loss of the bf16 engine (ep_size 2) and of HF's own bf16 model on this rank's
    batch, then 12 steps on that batch."""
    from helpers.hf import build_model, tokens

    from moe_plugin.integrations.deepspeed import initialize
    start_deepspeed(rank, world)
    report = {}
    for family in families:
        model = build_model(family, seed=5)
        ids = tokens(seed=40 + rank)
        # HF's own model cast to bf16 as the engine casts ours (eager experts: HF's default grouped_mm wants
        # 16-byte strides in bf16, which width 28 lacks)
        hf = build_model(family, seed=5, experts_implementation="eager").to(torch.bfloat16)
        with torch.no_grad():
            hf_loss = float(hf(input_ids=ids, labels=ids).loss)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": stage}, "moe": {"backend": "tutel", "ep_size": 2}}
        engine, _, _, _ = initialize(model=model, config=config)
        losses = []
        for _ in range(12):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        experts = {str(p.dtype) for n, p in engine.module.named_parameters() if ".moe.experts." in n}
        local = {b.moe.groups.layout.local_experts for b in engine.module.modules() if hasattr(b, "moe")}
        report[family] = dict(hf_loss=hf_loss, losses=losses, expert_dtypes=sorted(experts), local=sorted(local))
    return report


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_bf16_trains_swapped_hf_models_with_experts_split(stage):
    """The configuration most users run: an HF MoE model, DeepSpeed bf16, experts over two ranks."""
    pytest.importorskip("deepspeed")
    from helpers.hf import needs_transformers
    if needs_transformers.args[0]:
        pytest.skip(needs_transformers.kwargs["reason"])
    families = ["mixtral", "deepseek_v3"]
    for report in run_workers(deepspeed_bf16_hf_worker, 2, stage, families, timeout=300):
        for family, r in report.items():
            assert r["expert_dtypes"] == ["torch.bfloat16"], (family, r)
            assert r["local"] == ([3] if family == "mixtral" else [4]), (family, r)   # 6 / 8 experts over 2
            # the same model as HF's own in bf16 (rounding apart: HF routes in bf16, we in fp32)
            assert abs(r["losses"][0] - r["hf_loss"]) <= 2e-3 * r["hf_loss"], (family, r)
            assert all(math.isfinite(x) for x in r["losses"]), (family, r)
            assert r["losses"][-1] < 0.8 * r["losses"][0], (family, r)


def test_fairseq_bf16_means_tpu_in_fairseq_0_12():
    """fairseq 0.12's --bf16 implies --tpu (its options.py sets args.tpu, its Trainer then asks torch_xla for
    the device), so fairseq-train --bf16 cannot run on CPU or CUDA without torch_xla. What --bf16 does to
    the model is model.to(torch.bfloat16): test_fairseq_moe_ffn_trains_cast_to_bf16 covers that."""
    from helpers.fairseq import needs_fairseq
    if needs_fairseq.args[0]:
        pytest.skip(needs_fairseq.kwargs["reason"])
    from fairseq import options
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["data", "--arch", "transformer_lm", "--task", "language_modeling",
                                                "--bf16", "--cpu"])
    assert args.bf16 and args.tpu


def test_fairseq_moe_ffn_trains_cast_to_bf16():
    from helpers.fairseq import needs_fairseq
    if needs_fairseq.args[0]:
        pytest.skip(needs_fairseq.kwargs["reason"])
    from moe_plugin import MoEConfig
    from moe_plugin.integrations.fairseq_moe import layers
    torch.manual_seed(0)
    ffn = layers.MoEFFN(MoEConfig(model_dim=16, hidden_size=32, num_experts=4, top_k=2, min_capacity=0))
    ffn = ffn.to(dtype=torch.bfloat16)               # what fairseq's Trainer does under --bf16
    x_TBD = torch.randn(12, 4, 16).to(torch.bfloat16)
    target_TBD = torch.sin(3 * x_TBD.float()).to(torch.bfloat16)
    optimizer = torch.optim.Adam(ffn.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = (ffn(x_TBD).float() - target_TBD.float()).square().mean() + ffn.moe.aux_loss.float()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in ffn.parameters())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.7 * losses[0], losses
