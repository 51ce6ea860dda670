"""All-to-all and MoE-layer timings per parallel mode, across W gloo processes on this machine.

    python benchmarks/bench_parallel.py --world-size 4 --node-size 2

Part 1 times one all-to-all of --a2a-mb per rank, flat and 2DH. Part 2 times the layer's
forward+backward for every parallel degree r, overlap degree d and a2a kind, interleaved, and
gives each mode's ratio to (r=1, d=1, flat). Each process runs --threads intra-op threads.
Legend: W ranks, T tokens per rank, D model dim, H hidden, E experts.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.parallel.all_to_all import all_to_all, all_to_all_2dh
from moe_plugin.parallel.groups import build_groups


def _time(fn, rounds: int) -> list:
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench_a2a(args, rank, world) -> dict:
    groups = build_groups(world, 4, world, args.node_size)       # one expert per rank: only the groups matter
    rows = max(world, int(args.a2a_mb * 2**20 / 4 / args.model_dim) // world * world)
    x_RD = torch.randn(rows, args.model_dim)
    counts = [rows // world] * world
    counts_WW = torch.full((world, world), rows // world, dtype=torch.long)
    kinds = {"flat": lambda: all_to_all(x_RD, counts, counts, groups.ep_group),
             "2dh": lambda: all_to_all_2dh(x_RD, counts_WW, rank, groups.node_size, groups.intra_node_group,
                                           groups.inter_node_group)}
    times = {name: [] for name in kinds}
    for _ in range(args.rounds + 1):
        for name, fn in kinds.items():
            times[name] += _time(fn, 1)
    return {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}


def bench_layer(args, rank, world) -> dict:
    torch.manual_seed(0)
    config = MoEConfig(model_dim=args.model_dim, hidden_size=args.hidden_size, num_experts=args.num_experts,
                       top_k=2, capacity_factor=1.25, ep_size=world, node_size=args.node_size)
    layer = MoELayer(config)
    x_TD = torch.randn(args.tokens, args.model_dim, requires_grad=True)
    grad_TD = torch.randn_like(x_TD)
    modes = [(r, d, a2a) for r in layer.groups.layout.degrees() for d in (1, 2, 4) for a2a in ("flat", "2dh")
             if not (r == 0 and (d > 1 or a2a == "2dh"))]

    def step(mode):
        r, d, a2a = mode
        layer.config.a2a = a2a
        layer(x_TD, parallel=r, overlap_degree=d).backward(grad_TD)
    times = {mode: [] for mode in modes}
    for _ in range(args.rounds + 1):
        for mode in modes:
            times[mode] += _time(lambda: step(mode), 1)
    return {f"r={r} d={d} {a2a}": 1e3 * statistics.median(t[1:]) for (r, d, a2a), t in times.items()}


def worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(args.node_size))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {"a2a_ms": bench_a2a(args, rank, world), "layer_ms": bench_layer(args, rank, world)}
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            queue.put(gathered)
    except Exception:  # the parent prints it and stops instead of waiting for an answer
        queue.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--a2a-mb", type=float, default=16.0)
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=worker, args=(rank, args.world_size, port, args, queue))
             for rank in range(args.world_size)]
    for proc in procs:
        proc.start()
    per_rank = queue.get(timeout=1800)
    for proc in procs:
        proc.join(timeout=60)
    if isinstance(per_rank, str):
        raise SystemExit(per_rank)

    def slowest(key):   # a collective step ends when its slowest rank does
        return {name: max(r[key][name] for r in per_rank) for name in per_rank[0][key]}
    a2a, layer = slowest("a2a_ms"), slowest("layer_ms")
    if args.json:
        print(json.dumps({"args": vars(args), "a2a_ms": a2a, "layer_ms": layer}))
        return
    print(f"W={args.world_size} ranks (node size {args.node_size}), {args.threads} thread(s) each, gloo on CPU")
    print(f"all-to-all of {args.a2a_mb} MB per rank: " + ", ".join(f"{k} {v:.1f} ms" for k, v in a2a.items()))
    print(f"MoE layer fwd+bwd, T={args.tokens}/rank D={args.model_dim} H={args.hidden_size} "
          f"E={args.num_experts} top-2 cf=1.25, median of {args.rounds} (slowest rank):")
    base = layer["r=1 d=1 flat"]
    for name, ms in layer.items():
        print(f"  {name:<16} {ms:8.1f} ms  {ms / base:6.3f}x")


if __name__ == "__main__":
    main()
