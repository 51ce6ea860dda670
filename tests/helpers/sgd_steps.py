"""A tiny TransformerLM trained STEPS SGD steps on each rank's batches, against one process training on every rank's
batch (its loss the mean of the ranks', as DDP and FSDP compute): shared by the DDP and FSDP tests."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_plugin import MoEConfig, aux_loss
from moe_plugin.train.models import TransformerLM
from moe_plugin.train.models.transformer import ModelConfig

from .compare import relative_error

V, B, S, STEPS, LR = 50, 3, 6, 3, 0.3


def build(seed, ep_size, E, H, activation, bias, layers, recompute="none"):
    torch.manual_seed(seed)
    moe = MoEConfig(model_dim=8, hidden_size=H, num_experts=E, top_k=2, capacity_factor=1.0, min_capacity=0,
                    activation=activation, bias=bias, aux_loss_coef=0.01, ep_size=ep_size, recompute=recompute)
    model = TransformerLM(ModelConfig(dim=8, layers=layers, heads=2, seq_len=S, ffn_hidden=12, moe_every=2), moe, V)
    return model.double()   # fp64: the comparison with one process is exact to ~1e-12, far below any real error


def step_loss(model, x_BS, y_BS):
    return F.cross_entropy(model(x_BS).flatten(0, 1), y_BS.flatten()) + aux_loss(model)


def reference_losses(spec, batches, world):
    model = build(spec["seed"], 1, spec["E"], spec["H"], spec["activation"], spec["bias"], spec["layers"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        per_rank = [step_loss(model, *batches[step][r]) for r in range(world)]
        optimizer.zero_grad()
        (sum(per_rank) / world).backward()
        optimizer.step()
        losses.append([loss.item() for loss in per_rank])
    return losses


def sgd_error(model, batches, rank: int, world: int, want) -> tuple:
    """Train model STEPS SGD steps on this rank's batches; (worst relative error of every rank's losses against
    want, the one-process losses [step][rank], in fp64; how far want moved from its first step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    got = []
    for step in range(STEPS):
        loss = step_loss(model, *batches[step][rank])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        got.append(loss.item())
    everyone = [torch.zeros(STEPS, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, torch.tensor(got, dtype=torch.float64))
    got, want = torch.stack(everyone).t(), torch.tensor(want, dtype=torch.float64)
    return relative_error(got, want), (want[1:] - want[0]).abs().max().item()
