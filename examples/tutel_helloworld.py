"""A small training script written the way Tutel's helloworld calls moe_layer, on moe_plugin's drop-in.

The only Tutel-specific line is the import: `from moe_plugin import tutel as tutel_moe` (with --impl tutel the same
script imports Tutel's own `tutel.moe` instead, where Tutel is installed, to compare the two).

    torchrun --nproc_per_node 2 examples/tutel_helloworld.py --top 2 --capacity_factor 0 --parallel_type data

Each process holds --num_local_experts experts (expert parallel over the processes); the gate's weights are the same
on every process and their gradients are averaged by hand, the experts' are not (scan_expert_func marks them), as in
Tutel's example. --out DIR writes losses_rank<r>.json (the loss of every step) and init_rank<r>.pt (the layer's
state dict before the first step).
"""
import argparse
import importlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["moe_plugin", "tutel"], default="moe_plugin")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--num_tokens", type=int, default=64)
    parser.add_argument("--model_dim", type=int, default=32)
    parser.add_argument("--hidden_size", type=int, default=48)
    parser.add_argument("--num_local_experts", type=int, default=2)
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--capacity_factor", type=float, default=1.0)
    parser.add_argument("--parallel_type", default="adaptive:1")
    parser.add_argument("--l_aux_wt", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--num_steps", type=int, default=5)
    parser.add_argument("--out", default="")
    return parser.parse_args(argv)


def batch(args, rank: int):
    """This process's inputs [batch, tokens, model_dim] and targets (a token index per sample), the same every run."""
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch_size, args.num_tokens, args.model_dim, generator=generator)
    y = torch.randint(0, args.num_tokens, (args.batch_size,), generator=generator)
    return x, y


class ExampleModel(torch.nn.Module):
    def __init__(self, tutel_moe, args, rank: int):
        super().__init__()
        self.moe = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": args.top, "capacity_factor": args.capacity_factor},
            experts={"type": "ffn", "count_per_node": args.num_local_experts,
                     "hidden_size_per_expert": args.hidden_size, "activation_fn": F.relu},
            model_dim=args.model_dim,
            scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
            seeds=(1, rank + 1, 1),
            parallel_type=args.parallel_type,
        )

    def forward(self, x):
        return F.log_softmax(self.moe(x).sum(dim=2), dim=1)


def main(argv=None):
    args = parse(argv)
    tutel_moe = importlib.import_module("moe_plugin.tutel" if args.impl == "moe_plugin" else "tutel.moe")
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = ExampleModel(tutel_moe, args, rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = batch(args, rank)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.moe.state_dict(), os.path.join(args.out, f"init_rank{rank}.pt"))
    losses = []
    for step in range(args.num_steps):
        optimizer.zero_grad()
        output = model(x)
        loss = F.nll_loss(output, y) + args.l_aux_wt * model.moe.l_aux
        loss.backward()
        for param in model.parameters():      # the gate is replicated: average its gradient over the processes
            if world > 1 and not hasattr(param, "skip_allreduce") and param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= world
        optimizer.step()
        losses.append(float(loss))
        print(f"rank {rank} step {step}: loss = {float(loss):.6f}", flush=True)
    if args.out:
        with open(os.path.join(args.out, f"losses_rank{rank}.json"), "w") as file:
            json.dump(losses, file)
    if dist.is_initialized():
        dist.barrier()     # no process leaves while another still uses the group (gloo may abort at exit then)
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
