"""The fused layer's backward before and after the lean backward (issue 34 item 2), in one run: CPU time of
forward+backward and the bytes the forward keeps for backward (saved-tensor hooks; parameters not counted).

    OMP_NUM_THREADS=1 python benchmarks/bench_fused_backward.py --threads 1

"before" is moe_plugin/fused.py as of --before (a git revision: it kept the [R, D] expert output for the gate
gradient), loaded from git into this process and run on this checkout's kernels; "after" is this checkout's.
Each round runs every candidate once (interleaved); the table gives medians and after/before ratios.
Legend: T tokens, D model dim, H expert hidden dim, E experts, K top-k, R routed rows (T*K).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_plugin import MoEConfig
from moe_plugin.dispatch import plan_routes
from moe_plugin.experts import Experts
from moe_plugin.one_process.fused_experts import FusedMoE

ROOT = Path(__file__).resolve().parents[1]


def fused_at(revision: str):
    """FusedMoE from moe_plugin/fused.py at a git revision, imported inside this checkout's package."""
    source = subprocess.run(["git", "show", f"{revision}:moe_plugin/fused.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    # mlp_backward now returns the gate gradient last: the old caller takes the nine it knew
    source = source.replace("grad_x_RD, *weight_grads = grads", "grad_x_RD, *weight_grads = grads[:9]")
    path = Path(tempfile.mkdtemp()) / "fused_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("moe_plugin._fused_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.FusedMoE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--activation", default="swiglu")
    parser.add_argument("--capacity-factor", type=float, default=0.0)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--before", default="0270662")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    T, D, H, E, K = args.tokens, args.model_dim, args.hidden_size, args.num_experts, args.top_k
    torch.manual_seed(0)
    config = MoEConfig(model_dim=D, hidden_size=H, num_experts=E, top_k=K, activation=args.activation)
    experts = Experts(config).to(dtype)
    plan = plan_routes(torch.rand(T, E).argsort(dim=1)[:, :K], E, args.capacity_factor, 0)
    x_TD = torch.randn(T, D, dtype=dtype, requires_grad=True)
    gate_TK = torch.rand(T, K, dtype=dtype, requires_grad=True)
    grad_TD = torch.randn(T, D, dtype=dtype)
    params = set(map(id, experts.parameters()))
    candidates = {"before": fused_at(args.before), "after": FusedMoE}

    def step(function, saved=None):
        pack = (lambda t: saved.append(t) or t) if saved is not None else (lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y_TD = function.apply(x_TD, gate_TK, plan.pos_TK, plan.offs_E, experts.activation, experts.w1_EDH,
                                  experts.b1_EH, experts.w2_EHD, experts.b2_ED)
        y_TD.backward(grad_TD)

    saved_bytes = {}
    for name, function in candidates.items():
        saved = []
        step(function, saved)
        unique = {t.untyped_storage().data_ptr(): t for t in saved if id(t) not in params and t is not x_TD}
        saved_bytes[name] = sum(t.untyped_storage().nbytes() for t in unique.values())
    times = {name: [] for name in candidates}
    for round_index in range(args.rounds + 1):
        for name, function in candidates.items():
            start = time.perf_counter()
            step(function)
            if round_index:
                times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    result = dict(tokens=T, model_dim=D, hidden_size=H, num_experts=E, top_k=K, activation=args.activation,
                  dtype=args.dtype, threads=torch.get_num_threads(), rounds=args.rounds, before=args.before,
                  median_ms=ms, saved_mbytes={n: b / 1e6 for n, b in saved_bytes.items()},
                  time_after_over_before=ms["after"] / ms["before"],
                  saved_after_over_before=saved_bytes["after"] / saved_bytes["before"])
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"fused layer fwd+bwd, {args.dtype} {args.activation}, {result['threads']} threads, T={T} D={D} H={H} "
          f"E={E} k={K} cf={args.capacity_factor}, median of {args.rounds} rounds (before = one_process/fused_experts.py at {args.before})")
    print(f"{'':<8} {'ms':>9} {'saved MB (x, params not counted)':>34}")
    for name in candidates:
        print(f"{name:<8} {ms[name]:>9.2f} {saved_bytes[name] / 1e6:>34.2f}")
    print(f"after/before: time {result['time_after_over_before']:.3f}, saved bytes "
          f"{result['saved_after_over_before']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
