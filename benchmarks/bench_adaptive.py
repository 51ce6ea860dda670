"""The per-load tuner (parallel / overlap_degree / a2a "auto") against every static setting on a drifting load.

    python benchmarks/bench_adaptive.py --world-size 4 --node-size 2

The routing drifts: phase p adds --skews[p % len] to expert 0's routing score (router.expert_bias_E; 0 is
balanced routing, 1 sends every token's first choice to expert 0), for --steps-per-phase steps each. With
capacity_factor < 0 the capacity follows the load. Every step runs the adaptive layer and each static
(r, d, a2a) once, interleaved, on the same input and the same weights; a step's time is the slowest rank's
forward + backward. Before the timed steps, both layers run every setting once, untimed (each layer
has its own process groups). Printed: each one's total, the oracle (the sum over phases of the best static's
phase total), the ratios, and the adaptive layer's choices per phase.
Legend: W ranks, T tokens per rank, D model dim, H hidden, E experts.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_plugin import MoEConfig, MoELayer


def name_of(setting) -> str:
    r, d, a2a = setting
    return f"r={r} d={d} {a2a}" if r else "r=0"


def run(args, rank, world) -> dict:
    torch.manual_seed(0)
    config = dict(model_dim=args.model_dim, hidden_size=args.hidden_size, num_experts=args.num_experts,
                  top_k=args.top_k, capacity_factor=-args.capacity_cap, ep_size=world, node_size=args.node_size)
    searched = dict(parallel="auto", overlap_degree="auto" if "overlap_degree" in args.search else 1,
                    a2a="auto" if "a2a" in args.search else "flat")
    adaptive = MoELayer(MoEConfig(**config, **searched))
    static = MoELayer(MoEConfig(**config))
    static.load_state_dict({k: v for k, v in adaptive.state_dict().items() if not k.startswith("tuner.")})
    tuner = adaptive.tuner
    tuner.trials, tuner.drift, tuner.retune_every, tuner.prune = args.trials, args.drift, args.retune_every, args.prune
    tuner.prune_same_r, tuner.reject = args.prune_same_r, args.reject
    a2as = ["flat", "2dh"] if 1 < args.node_size < world else ["flat"]
    settings = [(0, 1, "flat")] + [(r, d, a2a) for r in static.groups.layout.degrees() if r
                                   for d in (1, 2, 4) for a2a in a2as]   # every static, whatever the tuner searches

    def step(layer, x_TD, grad_TD, setting=None):
        if setting is None:
            layer(x_TD).backward(grad_TD)
        else:
            a2a, layer.config.a2a = layer.config.a2a, setting[2]
            layer(x_TD, parallel=setting[0], overlap_degree=setting[1]).backward(grad_TD)
            layer.config.a2a = a2a

    warm_TD = torch.randn(args.tokens, args.model_dim, requires_grad=True)
    choose = tuner.choose
    for setting in settings:   # process warm-up (kernel choice, each layer's groups' first collectives): not counted
        step(static, warm_TD, torch.ones_like(warm_TD), setting)
        # the adaptive layer runs the setting too, untimed (explicit degrees), its a2a forced through choose
        tuner.choose = lambda *given, setting=setting, **named: (choose(*given, **named), setting)[1]
        step(adaptive, warm_TD, torch.ones_like(warm_TD), setting)
    del tuner.choose
    step(adaptive, warm_TD, torch.ones_like(warm_TD))

    names = ["adaptive"] + [name_of(s) for s in settings]
    seconds = {name: [] for name in names}
    chosen, phase_of_step = [], []
    generator = torch.Generator().manual_seed(1 + rank)
    for phase in range(args.phases):
        skew = args.skews[phase % len(args.skews)]
        for layer in (adaptive, static):
            layer.router.fixed_bias = True          # the bias chooses experts (as a host model's fixed bias)
            layer.router.expert_bias_E.zero_()
            layer.router.expert_bias_E[0] = skew
        for _ in range(args.steps_per_phase):
            x_TD = torch.randn(args.tokens, args.model_dim, generator=generator, requires_grad=True)
            grad_TD = torch.randn(args.tokens, args.model_dim, generator=generator)
            order = [None] + settings
            shift = len(phase_of_step) % len(order)           # rotate who goes first
            for setting in order[shift:] + order[:shift]:
                dist.barrier()
                start = time.perf_counter()
                step(adaptive if setting is None else static, x_TD, grad_TD, setting)
                seconds["adaptive" if setting is None else name_of(setting)].append(time.perf_counter() - start)
            ran = adaptive.stats
            chosen.append(name_of((ran["parallel"], ran["overlap_degree"], ran["a2a"])))
            phase_of_step.append(phase)
    table = torch.tensor([seconds[name] for name in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)          # a step takes as long as its slowest rank
    return dict(names=names, seconds=table.tolist(), chosen=chosen, phase=phase_of_step,
                table=adaptive.stats["tuned_table"], largest=adaptive.stats["capacity"])


def report(args, result) -> dict:
    names, seconds, phases = result["names"], result["seconds"], result["phase"]
    per_phase = [[sum(t for t, p in zip(row, phases) if p == phase) for phase in range(args.phases)] for row in seconds]
    totals = {name: sum(row) for name, row in zip(names, per_phase)}
    statics = [i for i, name in enumerate(names) if name != "adaptive"]
    best_per_phase = [min(statics, key=lambda i: per_phase[i][phase]) for phase in range(args.phases)]
    oracle = sum(per_phase[best][phase] for phase, best in enumerate(best_per_phase))
    best_static = min((names[i] for i in statics), key=totals.get)
    choices = []
    for phase in range(args.phases):
        counts = collections.Counter(c for c, p in zip(result["chosen"], phases) if p == phase)
        spread = sorted(per_phase[i][phase] for i in statics)
        choices.append({"phase": phase, "skew": args.skews[phase % len(args.skews)],
                        "best_static": names[best_per_phase[phase]],
                        "static_spread": round(spread[-1] / spread[0], 3),
                        "second_best_ratio": round(spread[1] / spread[0], 3),
                        "adaptive_s": round(per_phase[0][phase], 3),
                        "best_static_s": round(spread[0], 3), "adaptive_chose": dict(counts.most_common()),
                        "all_s": {names[i]: round(per_phase[i][phase], 3) for i in range(len(names))}})
    return {"totals_s": {k: round(v, 3) for k, v in sorted(totals.items(), key=lambda kv: kv[1])},
            "oracle_s": round(oracle, 3), "adaptive_over_oracle": round(totals["adaptive"] / oracle, 3),
            "best_static": best_static,
            "adaptive_over_best_static": round(totals["adaptive"] / totals[best_static], 3),
            "phases": choices, "tuned_table": result["table"]}


def worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(args.node_size))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run(args, rank, world)
        queue.put((rank, result if rank == 0 else None, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="T per rank")
    parser.add_argument("--model-dim", type=int, default=128)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-cap", type=float, default=4.0, help="capacity_factor = -this")
    parser.add_argument("--skews", type=lambda s: [float(v) for v in s.split(",")], default=[0.0, 1.0])
    parser.add_argument("--phases", type=int, default=6)
    parser.add_argument("--steps-per-phase", type=int, default=40)
    parser.add_argument("--search", type=lambda s: s.split(","), default=["parallel", "overlap_degree", "a2a"],
                        help="the fields the adaptive layer sets to auto (parallel always; the rest are 1 / flat)")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--drift", type=float, default=0.5)
    parser.add_argument("--prune", type=float, default=3.0, help="skip what the cost model puts past this x the best")
    parser.add_argument("--prune-same-r", type=float, default=1.25,
                        help="skip what the cost model puts past this x the best setting of the same r")
    parser.add_argument("--reject", type=float, default=1.3,
                        help="after one probe call, drop a setting past this x the best median")
    parser.add_argument("--retune-every", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()

    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [context.Process(target=worker, args=(rank, args.world_size, port, args, queue))
             for rank in range(args.world_size)]
    for proc in procs:
        proc.start()
    result = None
    for _ in range(args.world_size):
        rank, value, error = queue.get(timeout=args.timeout)
        if error:
            raise SystemExit(f"rank {rank} failed:\n{error}")
        result = value if rank == 0 else result
    for proc in procs:
        proc.join()
    print(json.dumps({"args": vars(args), **report(args, result)}, indent=1))


if __name__ == "__main__":
    main()
