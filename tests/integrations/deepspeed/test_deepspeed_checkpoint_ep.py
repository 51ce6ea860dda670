"""DeepSpeed backend checkpoints across ep sizes, on 2 gloo processes.

DeepSpeed writes each expert to its own file (layer_<L>_expert_<global id>_mp_rank_00_model_states.pt)
and, on load, each rank reads the files of the experts its current ep rank holds: the weights move
to another ep_size. Here: weights-only loads (load_optimizer_states=False or load_module_only=True), whose
optimizer starts fresh. A plain load moves the optimizer state too (layout.py and reshard.py convert DeepSpeed's
per-rank optimizer files, which fit only the layout that wrote them): test_deepspeed_checkpoint_layout.py.
"""
import os

import pytest
import torch

pytest.importorskip("deepspeed")
from helpers.launch import run_workers

SECTION = {"backend": "tutel", "num_experts": 4, "top_k": 2, "capacity_factor": 1.25, "min_capacity": 0}


def _engine(ep_size, seed):
    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM
    section = {**SECTION, "ep_size": ep_size}
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "moe": section}
    torch.manual_seed(seed)
    engine, _, _, _ = dsi.initialize(model=MoETransformerLM(section, seed=seed), config=config)
    return engine


def _train(engine, seed, steps):
    from moe_plugin.integrations.deepspeed.model import lm_loss, synthetic_batch
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = lm_loss(engine, synthetic_batch(generator, 8, 32, 64))
        engine.backward(loss + 0.01 * engine.module.l_aux())
        engine.step()


def _outputs(engine, seed):
    from moe_plugin.integrations.deepspeed.model import synthetic_batch
    tokens = synthetic_batch(torch.Generator().manual_seed(seed), 8, 32, 64)
    engine.eval()
    with torch.no_grad():
        y = engine(tokens[:, :-1])
    engine.train()
    return y


def _cross_ep_worker(rank, world, directory, save_ep, load_ep):
    import logging

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # the torch kernels: checkpoints are the subject here, and a JIT build of the native ones (shared
    # cache, one lock) can outlast the timeout on a busy machine
    os.environ["MOE_PLUGIN_KERNELS"] = "torch"
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")

    saved = _engine(save_ep, seed=1)
    _train(saved, 10 + rank, 3)
    saved.save_checkpoint(directory, tag="run")
    want = _outputs(saved, 99)     # the same probe batch on every rank
    report = {}
    for option in ("load_optimizer_states=False", "load_module_only=True"):
        loaded = _engine(load_ep, seed=2)
        fresh = _outputs(loaded, 99)
        kwargs = {"load_optimizer_states": False} if option.startswith("load_opt") else {"load_module_only": True}
        loaded.load_checkpoint(directory, tag="run", **kwargs)
        report[option] = ((_outputs(loaded, 99) - want).abs().max().item(), (fresh - want).abs().max().item())
        _train(loaded, 20 + rank, 1)   # and it trains on, with a fresh optimizer
    dist.barrier()
    report["files"] = sorted(os.listdir(os.path.join(directory, "run")))
    return report


@pytest.mark.timeout(240)
@pytest.mark.parametrize("save_ep, load_ep", [(2, 1), (1, 2)])
def test_weights_load_at_another_ep_size(tmp_path, save_ep, load_ep):
    for report in run_workers(_cross_ep_worker, 2, str(tmp_path), save_ep, load_ep, timeout=200):
        for option in ("load_optimizer_states=False", "load_module_only=True"):
            loaded, fresh = report[option]
            assert loaded < 1e-5 and fresh > 1e-2, (option, report[option])
        expert_files = [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)]
        assert set(expert_files) <= set(report["files"]), report["files"]
        assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)} <= set(report["files"])
