"""Replicas of hot experts (redundant_experts, issue 55 item 2) under the data-parallel hosts: a tiny TransformerLM
whose MoE router favours rank 0's experts trains 3 SGD steps with redundant_experts=0 and with copies, under
ddp_moe (4 gloo processes, ep_size 2: two ep groups) and FSDP2's fully_shard_moe (2 processes, ep_size 2); the losses
and every parameter after the steps are equal (fp64 1e-12), so every gradient was (the owners' include their
copies'). DeepSpeed's ZeRO stages: tests/integrations/deepspeed/test_deepspeed_replicas.py."""
import pytest
import torch
import torch.distributed as dist

from helpers.compare import relative_error
from helpers.launch import run_workers
from helpers.sgd_steps import B, LR, S, STEPS, V, step_loss
from moe_plugin import MoEConfig, MoELayer
from moe_plugin.train.models import TransformerLM
from moe_plugin.train.models.transformer import ModelConfig


def build(ep_size, redundant_experts):
    torch.manual_seed(0)
    moe = MoEConfig(model_dim=8, hidden_size=8, num_experts=4, top_k=2, capacity_factor=0.0, activation="swiglu",
                    router_bias=True, aux_loss_coef=0.01, ep_size=ep_size, redundant_experts=redundant_experts)
    model = TransformerLM(ModelConfig(dim=8, layers=2, heads=2, seq_len=S, ffn_hidden=12, moe_every=2), moe, V)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.router.bias_E.copy_(torch.tensor([3.0, 2.0, 0.0, 0.0]))     # rank 0 holds experts 0 and 1
    return model.double()


def train(model, batches, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = step_loss(model, *batches[step][rank])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    copies = [m.stats.get("replicas") for m in model.modules() if isinstance(m, MoELayer)]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return torch.stack(losses), [p.detach().clone() for p in local], copies


def compare(rank, world, host):
    generator = torch.Generator().manual_seed(7)
    batches = [[(torch.randint(V, (B, S), generator=generator), torch.randint(V, (B, S), generator=generator))
                for _ in range(world)] for _ in range(STEPS)]
    if host == "ddp":
        from moe_plugin.parallel import ddp_moe as wrap
    else:
        from moe_plugin.parallel import fully_shard_moe as wrap
    want, want_params, _ = train(wrap(build(2, 0)), batches, rank)
    got, got_params, copies = train(wrap(build(2, 3)), batches, rank)
    errors = [relative_error(got, want, floor=1e-12)] + [relative_error(a, b, floor=1e-12)
                                                          for a, b in zip(got_params, want_params)]
    start = build(2, 0)      # the steps moved the parameters (the comparison could fail)
    moved = max(relative_error(a, b) for a, b in zip(want_params, start.parameters())) if host == "ddp" else 1.0
    dist.barrier()
    return max(errors), copies, moved


@pytest.mark.timeout(600)
@pytest.mark.parametrize("host, world", [("ddp", 4), ("fsdp2", 2)])
def test_replicas_train_as_without_them(host, world):
    results = run_workers(compare, world, host, timeout=400)
    for error, copies, moved in results:
        assert error < 1e-12, (host, error)
        assert all(layer_copies for layer_copies in copies), copies      # every MoE layer made copies
        assert moved > 1e-3
