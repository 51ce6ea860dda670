"""Where a GPU forward+backward of MoELayer spends its time: torch.profiler's kernel table for one shape.

    python benchmarks/gpu/profile_layer.py [--model-dim 1024 --hidden-size 4096 --num-experts 8 --top-k 2
                                            --tokens 4096 --capacity-factor 1.25 --activation relu --no-bias]

Prints the step's wall time, the summed GPU kernel time per step (a wall time far above it means the host,
not the GPU, is the bottleneck) and the kernels that take the most GPU time.
"""
import argparse
import time

import torch

from moe_plugin import MoEConfig, MoELayer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dim", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--activation", default="relu")
    parser.add_argument("--no-bias", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=25, help="kernel table rows")
    args = parser.parse_args()

    config = MoEConfig(model_dim=args.model_dim, hidden_size=args.hidden_size, num_experts=args.num_experts,
                       top_k=args.top_k, capacity_factor=args.capacity_factor, activation=args.activation,
                       bias=not args.no_bias)
    layer = MoELayer(config).cuda()
    x_TD = torch.randn(args.tokens, config.model_dim, device="cuda", requires_grad=True)
    grad_TD = torch.randn(args.tokens, config.model_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        for p in list(layer.parameters()) + [x_TD]:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y_TD = layer(x_TD)
        y_TD.backward(grad_TD)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - start) / args.steps

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = profile.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type != torch.autograd.DeviceType.CPU)
    print(f"{vars(args)}\nwall {wall_ms:.3f} ms/step, GPU kernels {gpu_us / 1e3 / args.steps:.3f} ms/step")
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
