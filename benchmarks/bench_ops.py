"""Per-op time of the native routing kernels against the torch path, with each op's memory floor.

    python benchmarks/bench_ops.py --threads 2

(The fused grouped GEMMs against today's passes, on a GPU: benchmarks/gpu/fused_kernels.py.)

The floor of an op is the bytes it must read and write divided by the bandwidth of one large
tensor copy measured in the same run. Each round runs every candidate once (interleaved); the
table gives medians. "encode+decode fwd+bwd" is the autograd composition the layer uses:
x -> encode -> decode(gates) -> backward, through the moe_plugin custom ops.
Legend: T tokens, D model dim, E experts, K top-k, R routed rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from moe_plugin import ops
from moe_plugin.dispatch import plan_routes
from moe_plugin.ops import native, torch_ops


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copy_bandwidth(src: torch.Tensor, rounds: int) -> float:
    """Bytes read plus written per second by one large copy between existing buffers."""
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(timed(lambda: dst.copy_(src)) for _ in range(rounds))
    return 2 * src.numel() * src.element_size() / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--model-dim", type=int, default=1024)
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp64"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[args.dtype]
    kernels, why = native.load()
    if kernels is None:
        raise SystemExit(f"native kernels unavailable: {why}")

    T, D, E, K = args.tokens, args.model_dim, args.num_experts, args.top_k
    torch.manual_seed(0)
    expert_TK = torch.rand(T, E).argsort(dim=1)[:, :K]
    plan = plan_routes(expert_TK, E, args.capacity_factor, 4)
    R, pos_TK = plan.num_rows, plan.pos_TK
    kept_E = plan.kept_E
    row_start_E = kept_E.cumsum(0) - kept_E
    x_TD, grad_TD = torch.randn(T, D, dtype=dtype), torch.randn(T, D, dtype=dtype)
    y_RD = torch.randn(R, D, dtype=dtype)
    gate_TK = torch.rand(T, K, dtype=dtype)
    size, index = torch.finfo(dtype).bits // 8, 8
    routes = T * K * index                                                  # pos_TK
    ops_to_time = {  # name: (bytes it must move, native call, torch call)
        "route_slots": (T * K * index * 2 + R * index,
                        lambda m: m.route_slots(expert_TK, None, row_start_E, plan.capacity, R)),
        "encode fwd (scatter_rows)": ((T + R) * D * size + routes,
                                      lambda m: m.scatter_rows(x_TD, pos_TK, None, None, R)),
        "decode fwd (gather_sum, gates)": ((R + T) * D * size + routes + T * K * size,
                                           lambda m: m.gather_sum(y_RD, pos_TK, gate_TK, None)),
        "decode bwd (scatter_rows, gates, dots)": ((T + 2 * R) * D * size + routes + 2 * T * K * size,
                                                   lambda m: m.scatter_rows(grad_TD, pos_TK, gate_TK, y_RD, R)),
        "encode bwd (gather_sum)": ((R + T) * D * size + routes,
                                    lambda m: m.gather_sum(y_RD, pos_TK, None, None)),
    }
    kernel_sets = {"native": kernels, "torch": torch_ops}

    def encode_decode(choice: str) -> None:
        os.environ[ops.ENV] = choice
        x = x_TD.detach().requires_grad_()
        gate = gate_TK.detach().requires_grad_()
        rows_RD = ops.scatter_rows(x, pos_TK, None, None, R)[0]
        ops.gather_sum(rows_RD, pos_TK, gate, None)[0].backward(grad_TD)
    composite_bytes = sum(b for name, (b, _) in ops_to_time.items() if name != "route_slots")

    bandwidth = copy_bandwidth(torch.randn(max(T, R), D, dtype=dtype), args.rounds)
    times = {(name, kind): [] for name in list(ops_to_time) + ["encode+decode fwd+bwd"] for kind in kernel_sets}
    for round_index in range(args.rounds + 1):
        for name, (_, call) in ops_to_time.items():
            for kind, module in kernel_sets.items():
                seconds = timed(lambda: call(module))
                if round_index:
                    times[(name, kind)].append(seconds)
        for kind in kernel_sets:
            seconds = timed(lambda: encode_decode(kind))
            if round_index:
                times[("encode+decode fwd+bwd", kind)].append(seconds)
    os.environ.pop(ops.ENV, None)

    rows = []
    for name in list(ops_to_time) + ["encode+decode fwd+bwd"]:
        moved = composite_bytes if name == "encode+decode fwd+bwd" else ops_to_time[name][0]
        native_ms = 1e3 * statistics.median(times[(name, "native")])
        torch_ms = 1e3 * statistics.median(times[(name, "torch")])
        floor_ms = 1e3 * moved / bandwidth
        rows.append(dict(op=name, native_ms=native_ms, torch_ms=torch_ms, speedup=torch_ms / native_ms,
                         floor_ms=floor_ms, native_x_floor=native_ms / floor_ms, mbytes=moved / 1e6))
    result = dict(tokens=T, model_dim=D, num_experts=E, top_k=K, capacity_factor=args.capacity_factor,
                  rows_routed=R, dtype=args.dtype, threads=torch.get_num_threads(), rounds=args.rounds,
                  copy_gbytes_per_s=bandwidth / 1e9, ops=rows)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"routing ops, {args.dtype}, {result['threads']} threads, T={T} D={D} E={E} k={K} "
          f"cf={args.capacity_factor} (R={R} routed rows), median of {args.rounds} rounds; "
          f"large-copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write)")
    print(f"{'op':<40} {'MB moved':>9} {'floor ms':>9} {'native ms':>10} {'torch ms':>9} "
          f"{'torch/native':>13} {'native/floor':>13}")
    for row in rows:
        print(f"{row['op']:<40} {row['mbytes']:>9.1f} {row['floor_ms']:>9.2f} {row['native_ms']:>10.2f} "
              f"{row['torch_ms']:>9.2f} {row['speedup']:>13.2f} {row['native_x_floor']:>13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
