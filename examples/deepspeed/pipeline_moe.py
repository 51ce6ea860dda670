"""Pipeline parallelism with MoE layers: a deepspeed.pipe.PipelineModule whose stages hold DeepSpeed MoE layers,
run on moe_plugin's layer by "moe": {"backend": "tutel"} in the DeepSpeed JSON.

Each stage passes (x_BSD, aux_1) to the next: every MoE block adds its layer's balance loss to aux_1, so the
last stage's loss_fn sees the aux loss of every stage and its gradient flows back through the pipeline.
Experts are spread over ep_size ranks inside each stage's data-parallel group (DeepSpeed's pipe topology puts
the data-parallel ranks of a stage next to each other).

    torchrun --nproc_per_node 4 examples/deepspeed/pipeline_moe.py --deepspeed_config \
        examples/deepspeed/pipeline_moe.json --stages 2
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

# legend: B batch, S sequence, D model dim, V vocabulary
AUX_COEF = 0.01


def seeded_(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter of module drawn from its own generator: the same weights whatever the process layout."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            bound = 1.0 / math.sqrt(param.shape[-1])
            param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=generator))
    return module


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seed: int):
        super().__init__()
        self.embed = seeded_(nn.Embedding(vocab, dim), seed)

    def forward(self, tokens_BS):
        x_BSD = self.embed(tokens_BS)
        return x_BSD, x_BSD.new_zeros(1)


class MoEBlock(nn.Module):
    """x + MoE(norm(x)), with the layer's balance loss added to the running aux loss."""

    def __init__(self, dim: int, hidden: int, moe: dict, seed: int):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        expert = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.moe = MoE(dim, expert, num_experts=moe["num_experts"], ep_size=moe.get("ep_size", 1),
                       k=moe.get("top_k", 1), drop_tokens=moe.get("drop_tokens", True), use_rts=False,
                       top2_2nd_expert_sampling=False)
        seeded_(self.moe.deepspeed_moe.gate, seed)
        first = expert_parallel_rank(self.moe.ep_size) * self.moe.num_local_experts
        for i, local in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            seeded_(local, seed * 1000 + first + i)    # each expert from its global id

    def forward(self, inputs):
        x_BSD, aux_1 = inputs
        y_BSD, l_aux, _ = self.moe(self.norm(x_BSD))
        return x_BSD + y_BSD, aux_1 + l_aux


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int, seed: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = seeded_(nn.Linear(dim, vocab), seed)

    def forward(self, inputs):
        x_BSD, aux_1 = inputs
        return self.out(self.norm(x_BSD)), aux_1


def expert_parallel_rank(ep_size: int) -> int:
    return torch.distributed.get_rank() % ep_size if ep_size > 1 else 0


def layers(moe: dict, vocab: int = 64, dim: int = 32, hidden: int = 48, blocks: int = 2) -> list:
    """The model as a list of (class, args): LayerSpecs for a PipelineModule, or modules for nn.Sequential."""
    return ([(Embed, (vocab, dim, 1))] + [(MoEBlock, (dim, hidden, moe, 10 + i)) for i in range(blocks)]
            + [(Head, (dim, vocab, 2))])


def lm_loss(outputs, labels_BS):
    """Next-token cross entropy plus AUX_COEF times the balance losses of every MoE layer."""
    logits_BSV, aux_1 = outputs
    return F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten()) + AUX_COEF * aux_1.sum()


def pipeline(moe: dict, stages: int):
    from deepspeed.pipe import LayerSpec, PipelineModule
    return PipelineModule([LayerSpec(cls, *args) for cls, args in layers(moe)], num_stages=stages, loss_fn=lm_loss,
                          partition_method="uniform")


def batch(generator: torch.Generator, size: int, seq_len: int = 16, vocab: int = 64):
    """(tokens, next tokens) of sequences t[i+1] = (5 t[i] + 3) mod vocab from random starts."""
    starts_B = torch.randint(0, vocab, (size,), generator=generator)
    rows = [starts_B]
    for _ in range(seq_len):
        rows.append((5 * rows[-1] + 3) % vocab)
    tokens = torch.stack(rows, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def main():
    import json

    import deepspeed

    from moe_plugin.integrations.deepspeed import initialize
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    with open(args.deepspeed_config) as file:
        config = json.load(file)
    torch.manual_seed(0)
    model = pipeline(config["moe"], args.stages)
    engine, _, _, _ = initialize(args=args, model=model, model_parameters=model.parameters())
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    generator = torch.Generator().manual_seed(100 + engine.grid.get_data_parallel_rank())
    for step in range(args.steps):
        loss = engine.train_batch(iter([batch(generator, micro) for _ in range(accumulation)]))
        if torch.distributed.get_rank() == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
