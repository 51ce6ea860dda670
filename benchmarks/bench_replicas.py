"""Replicas of hot experts (issue 55 item 2) against no balancing and the tuner's adaptive r, side by side in one run,
on the issue's skew and on a flat load.

    python benchmarks/bench_replicas.py       # 4 gloo ranks, ep_size 4, 16 experts, top-2, dropless
    python benchmarks/bench_replicas.py --shares runs/x/metrics.jsonl --step 10 --layer 1 --top-k 4

The skew is bench_rank_load.py's: the router's choice bias is fitted so that experts 0-3, all held by rank 0, draw
--hot shares of the choices (default 0.23, 0.14, 0.13, 0.05); or, with --shares, each expert draws its share of the
load a run recorded (num_experts becomes the file's): a `moe-plugin train` run's metrics.jsonl (the record of --step,
MoE layer --layer's tokens_per_expert) or a `moe-plugin checkpoint routing` report's routing.json (layer --layer's
load). The flat load fits every expert to 1 / E. For each
load every rank trains each setting's layer --warmup steps (the tuner searches there), then --steps timed steps on
its own tokens, the settings interleaved within each step (the same tokens for each). Printed per setting:
    max_rank_load         RoutingMonitor's, over the timed steps (replicas' rows counted where they were computed)
    expert ms             the slowest rank's expert compute per step (forward + backward of the expert GEMMs), as
                          CPU time of the rank's one thread (time.thread_time: what the rank computes, whether or not
                          it shares a core; wall time on a machine with fewer cores than ranks measures the sharing),
                          the median over steps of the max over ranks
    step ms               the layer's forward + backward per step, wall time, the median over steps of the max over
                          ranks (on fewer cores than ranks it counts the waits for a core too)
    weights out / grads back   the bytes of expert weights sent per step over all ranks (replicas: the copies; r = 0:
                          the all-gather, each rank receiving the experts it does not hold) and of their gradients
                          sent back (replicas: the same bytes; r = 0: the all-reduce of every expert's gradient, as
                          a ring sends it, 2 (W - 1) / W times the whole stack per rank)
    setting               redundant_experts, or the tuner's r (or with "auto" its R) per step (how many steps chose
                          each); then the last step's copies (expert, rank), and with "auto" the tuner's dictionary
                          at the end (load key -> R, for the keys whose search has ended)
Legend: W ranks, T tokens per rank, D model dim, H hidden dim, E experts.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_plugin.dispatchers.all_to_all as a2a_dispatcher
import moe_plugin.dispatchers.local as local_dispatcher
from bench_rank_load import fit_bias
from moe_plugin import MoEConfig, MoELayer
from moe_plugin.experts import GroupedMLP
from moe_plugin.one_process.fused_experts import FusedMoE
from moe_plugin.routing_monitor import RoutingMonitor
from moe_plugin.routing_monitor.metrics import max_rank_load, rank_rows, rank_shares
from moe_plugin.parallel.groups import ExpertLayout

SETTINGS = (("no balancing", dict(parallel=1)), ("adaptive r", dict(parallel="auto")),
            ("replicas R=4", dict(parallel=1, redundant_experts=4)),
            ("replicas auto", dict(parallel=1, redundant_experts="auto")))
EXPERT_SECONDS = [0.0]       # this rank's expert compute since the last read


def timed(function):
    """An autograd function whose forward and backward add their thread CPU time to EXPERT_SECONDS."""
    class Timed(function):
        @staticmethod
        def forward(ctx, *args):
            start = time.thread_time()
            out = function.forward(ctx, *args)
            EXPERT_SECONDS[0] += time.thread_time() - start
            return out

        @staticmethod
        def backward(ctx, *grads):
            start = time.thread_time()
            out = function.backward(ctx, *grads)
            EXPERT_SECONDS[0] += time.thread_time() - start
            return out
    return Timed


def read_shares(path: str, step: int, layer: int) -> list:
    """Each expert's share of one MoE layer's load (counted choices) in a run's metrics.jsonl (the record of `step`)
    or a routing report's routing.json (`layer` counts the MoE layers from 0, in their order there)."""
    if path.endswith(".jsonl"):
        records = [json.loads(line) for line in open(path) if line.strip()]
        found = [r["tokens_per_expert"] for r in records if r.get("step") == step and "tokens_per_expert" in r]
        if not found:
            raise ValueError(f"--step {step}: {path} has no record of tokens_per_expert at that step")
        load = found[0][layer]
    else:
        load = list(json.load(open(path))["layers"].values())[layer]["load"]
    return [n / sum(load) for n in load]


def build(world, args, load, extra) -> MoELayer:
    E, D = args.num_experts, args.model_dim
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=D, hidden_size=args.hidden_size, num_experts=E, top_k=args.top_k,
                               capacity_factor=0.0, ep_size=world, **extra))
    layer.router.fixed_bias = True
    if load == "skew" and args.shares:
        target_E = torch.tensor(args.shares, dtype=torch.float64).clamp(min=1e-4)     # no expert at 0: its bias
        target_E /= target_E.sum()                                                  # would run to -inf
    else:
        hot = torch.tensor(args.hot if load == "skew" else [], dtype=torch.float64)
        target_E = torch.cat([hot, torch.full((E - len(hot),), (1 - float(hot.sum())) / (E - len(hot)),
                                              dtype=torch.float64)])
    fit_bias(layer, torch.randn(4096, D, generator=torch.Generator().manual_seed(1)), target_E)
    return layer


def measure(rank, world, args, load) -> dict:
    """Every setting's layer at this load, their steps interleaved (setting after setting within each step, so
    that a change in the machine's other load falls on all of them alike)."""
    E = args.num_experts
    layers = {name: build(world, args, load, extra) for name, extra in SETTINGS}
    extra_of = {name: extra.get("redundant_experts", 0) for name, extra in SETTINGS}
    weight_bytes = sum(p[0].numel() * p.element_size() for p in layers["no balancing"].experts.parameters())
    generator = torch.Generator().manual_seed(100 + rank)
    per_step = {name: [] for name in layers}
    degrees = {name: {} for name in layers}        # r per timed step, or with "auto" replicas the tuner's R
    monitors = {}
    for step in range(args.warmup + args.steps):
        x_TD = torch.randn(args.tokens, args.model_dim, generator=generator)
        for name, layer in layers.items():
            if step == args.warmup:
                monitors[name] = RoutingMonitor(layer)
            dist.barrier()
            EXPERT_SECONDS[0] = 0.0
            start = time.perf_counter()
            layer(x_TD).square().mean().backward()
            seconds = time.perf_counter() - start
            stats = layer.stats
            if step >= args.warmup:
                r = stats["parallel"]
                chosen = f"R={stats['redundant_experts']}" if extra_of[name] == "auto" else r
                degrees[name][chosen] = degrees[name].get(chosen, 0) + 1
                sent = stats.get("replica_bytes", 0) if r else (E - E // world) * weight_bytes
                back = sent if r else 2 * (world - 1) / world * E * weight_bytes
                per_step[name].append(torch.tensor([EXPERT_SECONDS[0], seconds, sent, back], dtype=torch.float64))
    results = {}
    for (name, extra), layer in zip(SETTINGS, layers.values()):
        metrics = monitors[name].read()[""]
        table = torch.stack(per_step[name])
        worst = table[:, :2].clone()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        sent = table[:, 2:].clone()
        dist.all_reduce(sent)
        results[load, name] = dict(
            max_rank_load=metrics["max_rank_load"], expert_ms=1e3 * statistics.median(worst[:, 0].tolist()),
            step_ms=1e3 * statistics.median(worst[:, 1].tolist()), out=float(sent[:, 0].mean()),
            back=float(sent[:, 1].mean()), setting=degrees[name] if extra_of[name] in (0, "auto") else extra_of[name],
            copies=layer.stats.get("replicas"),
            table={k: v.get("redundant_experts") for k, v in layer.stats.get("tuned_table", {}).items()}
            if extra_of[name] == "auto" else None)
    return results


def run(rank: int, world: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    a2a_dispatcher.GroupedMLP = timed(GroupedMLP)
    timed_fused = timed(FusedMoE)
    local_dispatcher.fused_moe = timed_fused.apply
    results = {**measure(rank, world, args, "skew"), **measure(rank, world, args, "flat")}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--model-dim", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048, help="T per rank per step")
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hot", type=float, nargs="+", default=[0.23, 0.14, 0.13, 0.05],
                        help="the shares of the choices of experts 0, 1, ... (held by rank 0)")
    parser.add_argument("--shares", default=None, metavar="FILE",
                        help="the skew from a run: its metrics.jsonl or a routing report's routing.json")
    parser.add_argument("--step", type=int, default=10, help="with --shares FILE.jsonl: the record's step")
    parser.add_argument("--layer", type=int, default=0, help="with --shares: the MoE layer (0 first)")
    args = parser.parse_args()
    skew = f"experts 0-{len(args.hot) - 1} at {args.hot}"
    if args.shares:
        args.shares = read_shares(args.shares, args.step, args.layer)
        args.num_experts = len(args.shares)
        rows_W = rank_rows(args.shares, rank_shares(ExpertLayout(args.num_experts, args.world_size,
                                                                 args.world_size, 0)))
        skew = f"the run's shares (max_rank_load {max_rank_load(rows_W):.3f} in the file)"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(run, args=(args.world_size, args, port, queue), nprocs=args.world_size, start_method="spawn")
    results = queue.get(timeout=60)
    print(f"W={args.world_size} ep_size={args.world_size} E={args.num_experts} top-{args.top_k} dropless, "
          f"D={args.model_dim} H={args.hidden_size} relu, fp32, T={args.tokens} per rank, {args.warmup} warm-up + "
          f"{args.steps} timed steps, 1 thread per rank; skew: {skew}")
    print(f"{'load':5} {'setting':14} {'max_rank_load':>13} {'expert ms':>9} {'step ms':>8} "
          f"{'weights out / grads back MB':>27}  chosen")
    for (load, name), row in results.items():
        print(f"{load:5} {name:14} {row['max_rank_load']:13.3f} {row['expert_ms']:9.1f} {row['step_ms']:8.1f} "
              f"{row['out'] / 1e6:13.2f} / {row['back'] / 1e6:<11.2f}  {row['setting']} {row['copies'] or ''}"
              + (f" tuned R per load key: {row['table']}" if row["table"] is not None else ""))


if __name__ == "__main__":
    main()
