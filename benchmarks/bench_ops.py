"""Per-op time of the native routing kernels against the torch path, with each op's memory floor.

    python benchmarks/bench_ops.py --threads 2
    python benchmarks/bench_ops.py --fused-gemms --json     # on a GPU: the fused grouped GEMMs against today's passes

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
    parser.add_argument("--fused-gemms", action="store_true",
                        help="on CUDA: time the fused up projection (ops/triton_grouped.gather_up) against scatter_rows + "
                             "grouped_mm + the activation, at --tokens/--model-dim/--hidden-size/--num-experts/--top-k")
    parser.add_argument("--hidden-size", type=int, default=1408)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[args.dtype]
    if args.fused_gemms:
        return fused_gemms_main(args, dtype)
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


def fused_gemms_main(args, dtype: torch.dtype) -> int:
    """The fused grouped GEMMs against what they replace, on CUDA (CUDA events, median of --rounds): gather_up (x's
    rows read by index, bias and activation in the epilogue) vs scatter_rows + grouped_mm + activation, per
    activation; dgrad_swiglu vs grouped_mm + the one-pass scaled SwiGLU backward."""
    from moe_plugin.ops import fused_gemms, torch_grouped, triton_grouped
    if not torch.cuda.is_available():
        raise SystemExit("--fused-gemms times CUDA kernels: no CUDA device here (the CPU runs today's path)")
    device = torch.device("cuda")
    T, D, H, E, K = args.tokens, args.model_dim, args.hidden_size, args.num_experts, args.top_k
    torch.manual_seed(0)
    plan = plan_routes(torch.rand(T, E).argsort(dim=1)[:, :K], E, 0.0, 0)
    pos_TK, offs_E, R = plan.pos_TK.to(device), plan.offs_E.to(device), plan.num_rows
    token_R = torch_grouped.tokens_of_rows(pos_TK, R)
    x_TD = torch.randn(T, D, dtype=dtype, device=device)
    rows = []
    fused_gemms.REPEATS = args.rounds
    for activation in torch_grouped.GATHER_UP_ACTIVATIONS:
        F = H if activation == "relu" else 2 * H
        w1_EDF = (torch.randn(E, D, F, device=device) / D ** 0.5).to(dtype)

        def fused():
            return triton_grouped.gather_up(x_TD, token_R, offs_E, w1_EDF, None, activation)

        def unfused():
            pre_RF = ops.grouped_mm(ops.scatter_rows(x_TD, pos_TK, None, None, R)[0], w1_EDF, offs_E)
            return pre_RF.relu_() if activation == "relu" else ops.swiglu(pre_RF) if activation == "swiglu" else \
                torch.nn.functional.gelu(pre_RF[:, :H]) * pre_RF[:, H:]
        fused_ms = 1e3 * fused_gemms.seconds(fused, device)
        unfused_ms = 1e3 * fused_gemms.seconds(unfused, device)
        rows.append(dict(kernel="gather_up", activation=activation, fused_ms=fused_ms, unfused_ms=unfused_ms,
                         fused_over_unfused=fused_ms / unfused_ms))
    grad_RD = torch.randn(R, D, dtype=dtype, device=device)
    w2_EHD = (torch.randn(E, H, D, device=device) / H ** 0.5).to(dtype)
    pre_RH2 = torch.randn(R, 2 * H, dtype=dtype, device=device)
    gate_R1 = torch.rand(R, 1, dtype=dtype, device=device)

    def fused_dgrad():
        return triton_grouped.dgrad_swiglu(grad_RD, offs_E, w2_EHD, pre_RH2, gate_R1)

    def unfused_dgrad():
        grad_act_RH = ops.grouped_mm(grad_RD, w2_EHD.transpose(1, 2), offs_E)
        return fused_gemms.activation_backward_scaled(pre_RH2, grad_act_RH, "swiglu", gate_R1)
    fused_ms, unfused_ms = (1e3 * fused_gemms.seconds(run, device) for run in (fused_dgrad, unfused_dgrad))
    rows.append(dict(kernel="dgrad_swiglu", activation="swiglu", fused_ms=fused_ms, unfused_ms=unfused_ms,
                     fused_over_unfused=fused_ms / unfused_ms))
    result = dict(tokens=T, model_dim=D, hidden_size=H, num_experts=E, top_k=K, dtype=args.dtype,
                  device=torch.cuda.get_device_name(), rounds=args.rounds, fused_gemms=rows)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"fused grouped GEMMs on {result['device']}, {args.dtype}, T={T} D={D} H={H} E={E} k={K} (R={R}), "
          f"median of {args.rounds}")
    for row in rows:
        print(f"{row['kernel']:<10} {row['activation']:<7} fused {row['fused_ms']:8.3f} ms  unfused "
              f"{row['unfused_ms']:8.3f} ms  fused/unfused {row['fused_over_unfused']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
