"""Fit, check and project the all-to-all / layer cost model of moe_plugin/parallel/cost_model.py.

    python benchmarks/a2a_cost_model.py                  # flat vs 2DH on the paper's cluster, 8..4,096 GPUs
    python benchmarks/a2a_cost_model.py --paper          # model vs every figure the Tutel paper states in text
    python benchmarks/a2a_cost_model.py --measure        # time flat / 2DH / intra-node exchanges on 4 gloo
                                                         # processes (node_size 2) here, fit GLOO_HERE
    python benchmarks/a2a_cost_model.py --drift          # a drifting load at 64 and 2,048 GPUs: per-phase best
                                                         # (r, d, algorithm), adaptive vs best static
Add --json for machine-readable output. Sizes are MiB (2**20 bytes) per rank, as in the paper.

Legend: S bytes one rank sends in one all-to-all, W ranks, L ranks per node, N = W / L nodes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

from moe_plugin.parallel import cost_model as cm

MiB = 2 ** 20
THETA = ("call_s", "startup_s", "per_peer_s", "inv_gbps", "inv_copy_gbps")


# ---------------------------------------------------------------- projection tables

def flat_vs_2dh(sizes_mib, node_size=8, max_gpus=4096, params=cm.NDM_A100_V4):
    rows = []
    for mib in sizes_mib:
        world = node_size
        while world <= max_gpus:
            flat = cm.a2a_seconds("flat", mib * MiB, world, node_size, params)
            hier = cm.a2a_seconds("2dh", mib * MiB, world, node_size, params)
            rows.append({"size_mib": mib, "gpus": world, "flat_ms": flat * 1e3, "2dh_ms": hier * 1e3,
                         "flat_over_2dh": flat / hier})
            world *= 2
    return rows


def crossover_gpus(size_mib, node_size=8, max_gpus=65536, params=cm.NDM_A100_V4):
    """The smallest W (powers of two times node_size) from which 2DH is faster than flat."""
    world = 2 * node_size
    while world <= max_gpus:
        if cm.a2a_seconds("2dh", size_mib * MiB, world, node_size, params) < \
                cm.a2a_seconds("flat", size_mib * MiB, world, node_size, params):
            return world
        world *= 2
    return None


# ---------------------------------------------------------------- the paper's statements

def paper_layer(world_size):
    """Section 5.2's layer: 16,384 tokens/step per GPU, f = 1, D = H = 2048, 2 experts per GPU, top-2,
    r = 1, fp16: every GPU sends 2 * 16384 rows of 2048 halves = 128 MiB per all-to-all."""
    return cm.Workload(rows_per_rank=2 * 16384, model_dim=2048, hidden_dim=2048, num_experts=2 * world_size)


def layer_gain_2dh(world_size, params, node_size=8):
    """flat / 2DH, one layer (forward + backward), r = 1, d = 1 (curves 2 and 3 of the paper's Figure 14)."""
    w = paper_layer(world_size)
    return (cm.layer_seconds(1, 1, "flat", w, world_size, node_size, params)
            / cm.layer_seconds(1, 1, "2dh", w, world_size, node_size, params))


def adaptive_pipelining_gain(world_size, params, node_size=8):
    """best (d, algorithm) / (d = 1, 2DH): curve 5 over curve 4 of Figure 14 (flexible all-to-all is
    not modelled)."""
    w = paper_layer(world_size)
    static = cm.layer_seconds(1, 1, "2dh", w, world_size, node_size, params)
    (choice, best) = cm.best_candidate([(1, d, a) for d in (1, 2, 4, 8) for a in cm.ALGORITHMS], w,
                                       world_size, node_size, params)
    return static / best, choice


def naive_aggregation_seconds(bytes_per_rank, world_size, node_size, params):
    """Appendix A.2's naive local aggregation: the intra-node exchange sends each local peer its N
    chunks as N separate messages of S/W (no stride copy first)."""
    N, L = world_size // node_size, node_size
    return params.call_us * cm.US + (L - 1) * N * (
        (params.intra_startup_us + params.intra_per_peer_us * (L - 1)) * cm.US
        + bytes_per_rank / world_size / (params.intra_gbps * cm.GB))


def fit_inter_per_peer(target=4.25, params=cm.NDM_A100_V4, world_size=2048):
    """The inter_per_peer_us at which the 2DH layer gain at world_size equals target (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(100):
        mid = (low + high) / 2
        if layer_gain_2dh(world_size, params.with_(inter_per_peer_us=mid)) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def paper_rows(params=cm.NDM_A100_V4):
    """One row per figure the paper states in its text: (where, statement, paper, model, agrees)."""
    rows = []

    def add(where, statement, paper, model, agrees):
        rows.append({"where": where, "statement": statement, "paper": paper, "model": model, "agrees": agrees})

    intra = cm.a2a_seconds("flat", 128 * MiB, 8, 8, params)
    add("A.2", "intra-node all-to-all, S = 128 MiB, 8 GPUs", "~600 us", f"{intra * 1e6:.0f} us",
        400e-6 <= intra <= 800e-6)
    naive = naive_aggregation_seconds(128 * MiB, 2048, 8, params)
    add("A.2", "naive local aggregation (no stride copy), intra-node step, 128 MiB, n = 2048", "~5 ms",
        f"{naive * 1e3:.1f} ms", 2.5e-3 <= naive <= 10e-3)
    steps = [cm.a2a_parts("2dh", 128 * MiB, w, 8, params) for w in (16, 2048)]
    first3 = [p["copies"] + p["intra"] for p in steps]
    add("A.3", "2DH phases 1-3 (copies + intra-node) do not grow with n (128 MiB, n = 16 vs 2048)",
        "constant", f"{first3[0] * 1e6:.0f} / {first3[1] * 1e6:.0f} us", abs(first3[1] / first3[0] - 1) < 0.01)
    small = [r for r in flat_vs_2dh([1], params=params) if r["gpus"] >= 64]
    add("A.5 / Fig. 18a", "1 MiB: 2DH faster from the smallest scale measured (64 GPUs) up to 4,096",
        "2DH faster", f"flat/2DH {small[0]['flat_over_2dh']:.2f}x at 64 .. {small[-1]['flat_over_2dh']:.1f}x "
        f"at 4096", all(r["flat_over_2dh"] > 1 for r in small))
    for mib in (32, 256):
        ratio = cm.a2a_seconds("flat", mib * MiB, 64, 8, params) / cm.a2a_seconds("2dh", mib * MiB, 64, 8, params)
        cross = crossover_gpus(mib, params=params)
        add(f"A.5 / Fig. 18{'b' if mib == 32 else 'c'}",
            f"{mib} MiB: 2DH slower on small clusters (64 GPUs), better as the GPU count grows",
            "flat faster at 64, 2DH later", f"flat/2DH {ratio:.2f}x at 64; 2DH faster from {cross} GPUs",
            ratio < 1 and cross is not None and cross <= 4096)
    gain = layer_gain_2dh(2048, params)
    a2a = (cm.a2a_seconds("flat", 128 * MiB, 2048, 8, params) / cm.a2a_seconds("2dh", 128 * MiB, 2048, 8, params))
    add("5.2 / Fig. 14", "2DH over linear, whole layer (fwd+bwd, r = 1, d = 1), 128 MiB, 2,048 GPUs", "4.25x",
        f"{gain:.2f}x (the all-to-all alone {a2a:.2f}x)", gain >= 4.25 * 0.99)
    for world, paper in ((16, 1.43), (2048, 1.04)):
        g, choice = adaptive_pipelining_gain(world, params)
        add("5.2 / Fig. 14", f"adaptive (d, algorithm) over (d = 1, 2DH), whole layer, {world} GPUs",
            f"{paper}x", f"{g:.2f}x, picks d={choice[1]} {choice[2]}", g >= 1.0)
    cross = {mib: crossover_gpus(mib, params=params) for mib in (32, 128, 256)}
    add("microsoft/Tutel issue #214 (a maintainer, not the paper)",
        "2DH overtakes linear from about 256 A100s (message size not given)", "~256 GPUs",
        "; ".join(f"{mib} MiB: from {w}" for mib, w in cross.items()), None)
    best = max(r["flat_over_2dh"] for r in flat_vs_2dh([1, 32, 128, 256], params=params) if r["gpus"] == 2048)
    add("v1 (arXiv 2206.03382v1), headline", "2DH all-to-all speedup at 2,048 GPUs (message size not given)",
        "20.7x", f"{best:.1f}x (largest of 1/32/128/256 MiB, at 1 MiB)", None)
    return rows


# ---------------------------------------------------------------- measuring and fitting here

def _features(algorithm, S, W, L):
    """Coefficients of THETA in a2a_seconds when both link levels share one resource (gloo on one
    host) and have the same parameters: the model is linear in THETA there."""
    N = W // L
    if algorithm == "flat" or L in (1, W):
        return [1.0, W - 1.0, (W - 1.0) ** 2, S * (W - 1) / W, 0.0]
    return [2.0, (L - 1.0) + (N - 1.0), (L - 1.0) ** 2 + (N - 1.0) ** 2, S * (L - 1) / L + S * (N - 1) / N, 2.0 * S]


def params_from_theta(theta, compute_tflops=cm.GLOO_HERE.compute_tflops):
    call, startup, per_peer, inv_b, inv_copy = (float(t) for t in theta)
    gbps = 1 / max(inv_b, 1e-12) / cm.GB
    return cm.Params(intra_startup_us=startup / cm.US, intra_per_peer_us=per_peer / cm.US, intra_gbps=gbps,
                     inter_startup_us=startup / cm.US, inter_per_peer_us=per_peer / cm.US, inter_gbps=gbps,
                     copy_gbps=1 / max(inv_copy, 1e-12) / cm.GB, call_us=call / cm.US,
                     compute_tflops=float(compute_tflops), levels_concurrent=False, overlap=False)


def fit_points(points):
    """Non-negative least squares of THETA on (algorithm, S, W, L, seconds) points, relative error."""
    from scipy.optimize import nnls
    A = [[c / sec for c in _features(alg, S, W, L)] for alg, S, W, L, sec in points]
    scale = [max(abs(row[j]) for row in A) or 1.0 for j in range(len(THETA))]
    theta, _ = nnls([[row[j] / scale[j] for j in range(len(THETA))] for row in A], [1.0] * len(A))
    return [t / s for t, s in zip(theta, scale)]


def _measure_worker(rank, world_size, sizes, trials, queue_port):
    import torch
    import torch.distributed as dist
    from moe_plugin.parallel.all_to_all import all_to_all, all_to_all_2dh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(queue_port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    L = 2
    intra = [dist.new_group([n * L + l for l in range(L)]) for n in range(world_size // L)]
    inter = [dist.new_group([n * L + l for n in range(world_size // L)]) for l in range(L)]
    my_intra, my_inter = intra[rank // L], inter[rank % L]
    D = 256                                        # fp32 rows of 1 KiB
    results = {}
    for S in sizes:
        rows = S // (4 * D)
        x = torch.randn(rows, D)
        per = [rows // world_size] * world_size
        counts = torch.full((world_size, world_size), rows // world_size, dtype=torch.long)
        half = [rows // L] * L
        ops = {"flat": lambda: all_to_all(x, per, per, None),
               "2dh": lambda: all_to_all_2dh(x, counts, rank, L, my_intra, my_inter),
               "intra": lambda: all_to_all(x, half, half, my_intra)}
        times = {k: [] for k in ops}
        for trial in range(trials + 2):            # the first two are warm-up
            for kind, op in ops.items():
                dist.barrier()
                start = time.perf_counter()
                op()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if trial >= 2:
                    times[kind].append(float(elapsed))
        results[S] = {k: statistics.median(v) for k, v in times.items()}
    dist.destroy_process_group()
    return results


def _spawned(rank, world_size, sizes, trials, port, queue):
    queue.put((rank, _measure_worker(rank, world_size, sizes, trials, port)))


def measure(sizes_bytes, trials=7, world_size=4, timeout=900):
    """Median (over trials, slowest rank each) seconds of flat, 2DH (node_size 2) and the intra-node
    exchange (2 ranks) on world_size gloo processes here, interleaved trial by trial."""
    import queue as queues
    import socket
    import torch.multiprocessing as mp
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:            # the spawned processes import this file by its module name
        sys.path.insert(0, here)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, world_size, list(sizes_bytes), trials, port, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, value = queue.get(timeout=1.0)
                results[rank] = value
            except queues.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"gloo measurement failed: exit codes {[p.exitcode for p in procs]}, "
                                       f"{len(results)} of {world_size} ranks answered within {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return results[0]


def measured_points(results, world_size=4, node_size=2):
    points = []
    for S, by_kind in sorted(results.items()):
        points.append(("flat", S, world_size, node_size, by_kind["flat"]))
        points.append(("2dh", S, world_size, node_size, by_kind["2dh"]))
        points.append(("flat", S, node_size, node_size, by_kind["intra"]))
    return points


def compute_tflops_here(threads=1, repeats=5):
    import torch
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 512), torch.randn(512, 2048)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * 2048 * 512 * 2048 / best / cm.TFLOP


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------- a drifting load

DRIFT_PHASES = (1.0, 2.0, 4.0, 8.0, 3.0, 1.5)


def drift_workloads(world_size, loads=DRIFT_PHASES, tokens_per_rank=4096, top_k=2, model_dim=2048,
                    hidden_dim=2048, experts_per_slice=4, dtype_bytes=2):
    """One Workload per phase. num_experts = world_size / experts_per_slice, so each expert is sliced
    over experts_per_slice ranks and r can be 0, 1, 2, ...; in a phase of load f the busiest rank
    exchanges and computes f times the rows a rank routes (skewed routing, capacity following the
    load), while r = 0 computes only its own rows."""
    E = max(1, world_size // experts_per_slice)
    own = top_k * tokens_per_rank
    return [cm.Workload(rows_per_rank=int(round(f * own)), model_dim=model_dim, hidden_dim=hidden_dim,
                        num_experts=E, dtype_bytes=dtype_bytes, local_rows=own) for f in loads]


def project_schedule(workloads, world_size, node_size, params, steps_per_phase=1,
                     overlap_degrees=(1, 2, 4, 8)):
    """Per phase the fastest (r, d, algorithm); the best single static setting over the whole schedule;
    adaptive (per-phase best) against it."""
    candidates = [(r, d, a) for r in cm.degrees(world_size, workloads[0].num_experts)
                  for d in (overlap_degrees if r else (1,)) for a in (cm.ALGORITHMS if r else ("flat",))]
    table = {c: [cm.layer_seconds(*c, w, world_size, node_size, params) * steps_per_phase for w in workloads]
             for c in candidates}
    per_phase = [min(candidates, key=lambda c: table[c][i]) for i in range(len(workloads))]
    adaptive = sum(table[c][i] for i, c in enumerate(per_phase))
    static = min(candidates, key=lambda c: sum(table[c]))
    return {"world_size": world_size, "node_size": node_size,
            "phases": [{"rows_per_rank": w.rows_per_rank, "best": list(c), "ms": table[c][i] * 1e3 / steps_per_phase}
                       for i, (w, c) in enumerate(zip(workloads, per_phase))],
            "adaptive_ms": adaptive * 1e3, "best_static": list(static), "best_static_ms": sum(table[static]) * 1e3,
            "static_over_adaptive": sum(table[static]) / adaptive}


# ---------------------------------------------------------------- command line

def _print_rows(rows, columns):
    print("  ".join(f"{c:>14}" for c in columns))
    for r in rows:
        print("  ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{str(r[c]):>14}" for c in columns))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--paper", action="store_true", help="model vs the paper's statements, and the fit")
    mode.add_argument("--measure", action="store_true", help="measure gloo here and fit the model to it")
    mode.add_argument("--drift", action="store_true", help="project a drifting load at 64 and 2,048 GPUs")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--max-gpus", type=int, default=4096)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--loads", type=float, nargs="+", default=list(DRIFT_PHASES),
                        help="--drift: the busiest rank's load per phase, in units of a rank's own rows")
    parser.add_argument("--tokens-per-rank", type=int, default=4096, help="--drift: tokens per rank per step")
    parser.add_argument("--top-k", type=int, default=2, help="--drift")
    parser.add_argument("--dim", type=int, default=2048, help="--drift: model dim D")
    parser.add_argument("--hidden", type=int, default=2048, help="--drift: expert hidden dim H")
    parser.add_argument("--experts-per-slice", type=int, default=4,
                        help="--drift: ranks per expert (num_experts = GPUs / this; 1 means one expert per GPU)")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="--drift: bytes per element")
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 2048], help="--drift: cluster sizes")
    parser.add_argument("--node-size", type=int, default=8, help="--drift: ranks per node")
    parser.add_argument("--params", choices=["paper", "gloo"], default="paper",
                        help="--drift: NDM_A100_V4 (the paper's cluster) or GLOO_HERE (this machine)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("sizes_mib", "loads"):
        if any(not v > 0 for v in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} must all be > 0, got {getattr(args, name)}")
    for name in ("tokens_per_rank", "top_k", "dim", "hidden", "experts_per_slice", "dtype_bytes", "node_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(w < 1 or w % args.node_size for w in args.gpus):
        parser.error(f"--gpus must be multiples of --node-size ({args.node_size}), got {args.gpus}")
    if args.max_gpus < 8:
        parser.error(f"--max-gpus must be >= 8 (one node of the paper's cluster), got {args.max_gpus}")

    if args.paper:
        rows = paper_rows()
        out = {"params": asdict(cm.NDM_A100_V4), "fitted_inter_per_peer_us": fit_inter_per_peer(), "rows": rows}
        if args.json:
            print(json.dumps(out, indent=2))
            return 0
        print(f"NDm A100 v4 params: {asdict(cm.NDM_A100_V4)}")
        print(f"inter_per_peer_us fitted to the 4.25x layer gain at 2,048 GPUs: {out['fitted_inter_per_peer_us']:.5f}")
        for r in rows:
            mark = {True: "yes", False: "NO", None: "-"}[r["agrees"]]
            print(f"[{r['where']}] {r['statement']}\n    paper: {r['paper']}   model: {r['model']}   agrees: {mark}")
        return 0
    if args.measure:
        sizes = [int(m * MiB) for m in (1 / 64, 1 / 16, 1 / 4, 1, 4, 16)]
        results = measure(sizes, trials=args.trials)
        points = measured_points(results)
        theta = fit_points(points)
        fitted = params_from_theta(theta, compute_tflops=compute_tflops_here())
        rows = [{"kind": "intra(W=2)" if W == 2 else alg, "size_mib": S / MiB, "measured_ms": sec * 1e3,
                 "model_ms": cm.a2a_seconds(alg, S, W, L, fitted) * 1e3}
                for alg, S, W, L, sec in points]
        if args.json:
            print(json.dumps({"params": asdict(fitted), "rows": rows}, indent=2))
            return 0
        print(f"fitted on 4 gloo processes, node_size 2, this machine: {asdict(fitted)}")
        _print_rows(rows, ["kind", "size_mib", "measured_ms", "model_ms"])
        return 0
    if args.drift:
        shape = dict(tokens_per_rank=args.tokens_per_rank, top_k=args.top_k, model_dim=args.dim,
                     hidden_dim=args.hidden, experts_per_slice=args.experts_per_slice, dtype_bytes=args.dtype_bytes)
        params = cm.NDM_A100_V4 if args.params == "paper" else cm.GLOO_HERE
        out = [project_schedule(drift_workloads(w, args.loads, **shape), w, args.node_size, params) for w in args.gpus]
        if args.json:
            print(json.dumps(out, indent=2))
            return 0
        for o in out:
            print(f"\n{o['world_size']} ranks, node size {args.node_size}, params {args.params}, {shape}, "
                  f"loads {args.loads}:")
            for w, p in zip(args.loads, o["phases"]):
                r, d, a = p["best"]
                setting = f"r={r} d={d} {a}" if r else "r=0 (no exchange)"
                print(f"  load {w:>4g}x  rows {p['rows_per_rank']:>7}  best {setting:<18} {p['ms']:8.2f} ms")
            print(f"  adaptive {o['adaptive_ms']:.2f} ms; best static {tuple(o['best_static'])} "
                  f"{o['best_static_ms']:.2f} ms; static/adaptive {o['static_over_adaptive']:.2f}x")
        return 0
    rows = flat_vs_2dh(args.sizes_mib, max_gpus=args.max_gpus)
    if args.json:
        print(json.dumps({"params": asdict(cm.NDM_A100_V4), "rows": rows}, indent=2))
        return 0
    print(f"NDm A100 v4 params: {asdict(cm.NDM_A100_V4)}")
    _print_rows(rows, ["size_mib", "gpus", "flat_ms", "2dh_ms", "flat_over_2dh"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
