"""The HF experts backend "moe_plugin" against HF's default "grouped_mm" backend, in one run.

The same HF block (same weights) at the Mixtral-like and DeepSeek-V3-like shapes of bench_hf.py, forward +
backward of T tokens, fp32:
  experts   HF's experts module alone, on the routes HF's router gave (top_k_index, top_k_weights captured
            from one block forward): the part an experts backend replaces
  block     the whole block: HF's router (and DeepSeek-V3's shared expert) + the experts
Calls alternate between the backends (round robin); medians, and moe_plugin / grouped_mm (< 1: ours faster),
of wall time and of this process's CPU time (time.process_time: on a shared, loaded machine a single-thread
run's CPU time leaves out the time other processes held the core, which wall time counts).

    OMP_NUM_THREADS=1 python benchmarks/bench_hf_experts_backend.py --threads 1 --repeats 10 --warmup 2
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hf import BLOCK_SHAPES, block_config, hf_block  # noqa: E402  (imports the backend too)

BACKENDS = ("grouped_mm", "moe_plugin")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("all",) + tuple(BLOCK_SHAPES), default="all")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per backend")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def timed(fn, variants, repeats, warmup):
    """{clock: {variant: median seconds}} of fn(variant), calls interleaved round robin; clocks wall and cpu."""
    times = {clock: {name: [] for name in variants} for clock in ("wall", "cpu")}
    for i in range(warmup + repeats):
        for name, variant in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn(variant)
            if i >= warmup:
                times["wall"][name].append(time.perf_counter() - wall)
                times["cpu"][name].append(time.process_time() - cpu)
    return {clock: {name: statistics.median(t) for name, t in by_name.items()} for clock, by_name in times.items()}


def with_backend(block, backend):
    block = copy.deepcopy(block)
    block.experts.config = copy.deepcopy(block.experts.config)
    block.experts.config._experts_implementation = backend
    return block


def captured_routes(block, x):
    """(hidden_states, top_k_index, top_k_weights) the block's router hands its experts for x."""
    seen = {}
    hook = block.experts.register_forward_pre_hook(lambda module, args: seen.setdefault("args", args))
    with torch.no_grad():
        block(x)
    hook.remove()
    return tuple(a.detach() for a in seen["args"])


def bench_shape(name, args):
    shape = BLOCK_SHAPES[name]
    blocks = {b: with_backend(hf_block(block_config(shape), "grouped_mm"), b) for b in BACKENDS}
    x = torch.randn(1, args.tokens, shape["D"])
    grad = torch.randn_like(x)
    hidden, index, weights = captured_routes(blocks["grouped_mm"], x)
    grad_hidden = torch.randn_like(hidden)
    with torch.no_grad():   # the same function: check before timing
        ours, theirs = blocks["moe_plugin"](x), blocks["grouped_mm"](x)
        diff = float((ours - theirs).abs().max() / theirs.abs().max())
    assert diff < 1e-5, f"moe_plugin differs from grouped_mm by {diff:.3g}"

    def experts_step(block):
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        block.experts(h, index, w).backward(grad_hidden)
        block.zero_grad(set_to_none=True)

    def block_step(block):
        block(x.clone().requires_grad_()).backward(grad)
        block.zero_grad(set_to_none=True)

    results = []
    for case, step in (("experts", experts_step), ("block", block_step)):
        clocks = timed(step, blocks, args.repeats, args.warmup)
        results.append({"case": f"{case}/{name}", **shape, "tokens": args.tokens, "max_rel_diff": diff,
                        **{f"{clock}_ms": {b: round(s * 1e3, 1) for b, s in seconds.items()}
                           for clock, seconds in clocks.items()},
                        **{f"{clock}_ratio": round(seconds["moe_plugin"] / seconds["grouped_mm"], 3)
                           for clock, seconds in clocks.items()}})
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = tuple(BLOCK_SHAPES) if args.shape == "all" else (args.shape,)
    results = [r for name in names for r in bench_shape(name, args)]
    import transformers
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                          "transformers": transformers.__version__, "results": results}))
        return
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"{args.tokens} tokens, forward + backward")
    for r in results:
        for clock in ("wall", "cpu"):
            times = ", ".join(f"{k} {v} ms" for k, v in r[f"{clock}_ms"].items())
            print(f"{r['case']:18s} {clock:4s} {times}; moe_plugin / grouped_mm = {r[f'{clock}_ratio']}")


if __name__ == "__main__":
    main()
