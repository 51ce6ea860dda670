"""Replicas of hot experts (redundant_experts, issue 55 item 2) under DeepSpeed ZeRO stages 1, 2 and 3 (2 gloo
processes, moe_plugin's native-API MoE at ep_size 2, the router favouring rank 0's experts): 3 SGD steps with copies
give the losses of redundant_experts=0 under the same stage (fp32 1e-5), and copies were made."""
import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
from helpers.compare import relative_error
from helpers.launch import run_workers

pytestmark = pytest.mark.slow
D, H, E = 8, 12, 4
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
          "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.2}}}


class Skewed(nn.Module):
    """x -> Linear -> the native-API MoE (4 experts, top-2, dropless, ep_size 2) whose router favours experts 0, 1."""

    def __init__(self, redundant_experts):
        super().__init__()
        import moe_plugin.integrations.deepspeed as dsi
        torch.manual_seed(0)
        self.pre = nn.Linear(D, D)
        expert = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
        self.moe = dsi.MoE(D, expert, num_experts=E, ep_size=2, k=2, drop_tokens=False, use_rts=False,
                           top2_2nd_expert_sampling=False, redundant_experts=redundant_experts)
        torch.manual_seed(1)
        layer = self.moe.deepspeed_moe
        with torch.no_grad():
            layer.router.weight_ED.normal_(0, 0.5)
            layer.router.weight_ED[:2] += 1.0        # tokens of mean 1 go to experts 0 and 1 (rank 0's)
            for tensor in layer.experts.parameters():
                tensor.normal_(0, 0.3)

    def forward(self, x):
        return self.moe(self.pre(x))[0]


def worker(rank, world):
    import logging
    import os

    import deepspeed
    from deepspeed.utils import logger

    import moe_plugin.integrations.deepspeed as dsi
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    report = {}
    for stage in (1, 2, 3):
        zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
        for redundant in (0, 2):
            engine = dsi.initialize(model=Skewed(redundant), config={**CONFIG, "zero_optimization": zero})[0]
            losses = []
            for step in range(3):
                generator = torch.Generator().manual_seed(10 * step + rank)
                x = torch.randn(11 + 4 * rank, D, generator=generator) + 1.0
                target = torch.randn(x.shape, generator=generator)
                loss = ((engine(x) - target) ** 2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            report[stage, redundant] = losses
            report[stage, redundant, "copies"] = engine.module.moe.deepspeed_moe.stats.get("replicas")
    return report


def test_replicas_under_zero_1_2_3_train_as_without_them():
    for report in run_workers(worker, 2, timeout=400):
        for stage in (1, 2, 3):
            assert report[stage, 2, "copies"], report         # copies were made
            assert relative_error(report[stage, 2], report[stage, 0]) < 1e-5, (stage, report)
            assert abs(report[stage, 0][2] - report[stage, 0][0]) > 1e-3      # the steps moved the loss
