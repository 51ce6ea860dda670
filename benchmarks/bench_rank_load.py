"""max_rank_load (issue 55 item 1) on a skewed router: the busiest expert-parallel rank's routed rows over the mean
rank's, as RoutingMonitor logs it, beside the rows counted from each process's routes.

    python benchmarks/bench_rank_load.py                          # 4 gloo ranks, ep_size 4, 16 experts, top-2

The router's choice bias (router.expert_bias_E with fixed_bias, as DeepSeek-V3's aux-loss-free routing; the gates
are untouched) is fitted on a calibration batch, the same on every rank, so that experts 0-3, all held by rank 0,
draw --hot shares of the choices (default 0.23, 0.14, 0.13, 0.05, the issue's skew) and the other experts share the
rest evenly. Then every rank trains --steps dropless steps on its own tokens and the monitor reads the window.
Printed: the measured expert shares of experts 0-3, rows per rank (counted from the routes), max_rank_load from the
hand count and from RoutingMonitor. Legend: W ranks, T tokens per rank, D model dim, E experts.
"""
from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.routing_monitor.metrics import RoutingMonitor


def fit_bias(layer: MoELayer, x_TD: torch.Tensor, target_E: torch.Tensor, rounds: int = 200) -> None:
    """expert_bias_E moved until the shares of the choices on x_TD are near target_E."""
    router = layer.router
    with torch.no_grad():
        for _ in range(rounds):
            expert_TK = router(x_TD).expert_TK
            share_E = torch.bincount(expert_TK.reshape(-1), minlength=target_E.numel()).double() / expert_TK.numel()
            router.expert_bias_E.add_(0.02 * torch.log(target_E / share_E.clamp(min=1e-4)).float())


def run(rank: int, world: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    E, D = args.num_experts, args.model_dim
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=D, hidden_size=args.hidden_size, num_experts=E, top_k=args.top_k,
                               capacity_factor=0.0, ep_size=world))
    layer.router.fixed_bias = True
    hot = torch.tensor(args.hot, dtype=torch.float64)
    target_E = torch.cat([hot, torch.full((E - len(hot),), (1 - float(hot.sum())) / (E - len(hot)),
                                          dtype=torch.float64)])
    fit_bias(layer, torch.randn(4096, D, generator=torch.Generator().manual_seed(1)), target_E)
    monitor = RoutingMonitor(layer)
    rows_W, load_E = torch.zeros(world, dtype=torch.float64), torch.zeros(E, dtype=torch.float64)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(args.steps):
        x_TD = torch.randn(args.tokens, D, generator=generator)
        with torch.no_grad():
            expert_TK = layer.router(x_TD).expert_TK.reshape(-1)
        load_E += torch.bincount(expert_TK, minlength=E).double()
        rows_W += torch.bincount(expert_TK // (E // world), minlength=world).double()
        layer(x_TD).square().mean().backward()
    metrics = monitor.read()[""]
    dist.all_reduce(rows_W)
    dist.all_reduce(load_E)
    if rank == 0:
        queue.put(dict(shares=(load_E / load_E.sum())[:len(hot)].tolist(), rows_per_rank=rows_W.tolist(),
                       hand=float(rows_W.max() / rows_W.mean()), monitor=metrics["max_rank_load"],
                       max_load=metrics["max_load"]))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--model-dim", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=2048, help="T per rank per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hot", type=float, nargs="+", default=[0.23, 0.14, 0.13, 0.05],
                        help="the shares of the choices of experts 0, 1, ... (held by rank 0)")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(run, args=(args.world_size, args, port, queue), nprocs=args.world_size, start_method="spawn")
    result = queue.get(timeout=60)
    print(f"W={args.world_size} ep_size={args.world_size} E={args.num_experts} top-{args.top_k} dropless, "
          f"T={args.tokens} per rank x {args.steps} steps")
    print("shares of experts 0-{}: {}".format(len(args.hot) - 1, ", ".join(f"{s:.3f}" for s in result["shares"])))
    print("rows per rank: " + ", ".join(f"{r:.0f}" for r in result["rows_per_rank"]))
    print(f"max_rank_load: {result['monitor']:.3f} (RoutingMonitor), {result['hand']:.3f} (counted from the routes); "
          f"max_load {result['max_load']:.2f}")


if __name__ == "__main__":
    main()
