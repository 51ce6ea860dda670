"""Where a GPU forward+backward of MoELayer spends its time: torch.profiler's kernel table for one shape.

    python benchmarks/gpu/profile_layer.py --autocast bf16 [the shape flags of `moe-plugin bench`,
        e.g. --model-dim 2048 --hidden-size 1408 --num-experts 64 --top-k 6 --tokens 16384 --capacity-factor 0
        --activation swiglu --no-bias] [--steps 5] [--rows 25]

Prints the step's wall time, the summed GPU kernel time per step (a wall time far above it means the host,
not the GPU, is the bottleneck) and the kernels that take the most GPU time. Of bench's flags it uses the
shape, --dtype, --autocast and --seed.
"""
import argparse
import contextlib
import time

import torch

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.cli.bench import DTYPES, add_arguments


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=25, help="kernel table rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("profile_layer.py profiles the layer on a GPU: no CUDA device is available")

    torch.manual_seed(args.seed)
    config = MoEConfig(model_dim=args.model_dim, hidden_size=args.hidden_size, num_experts=args.num_experts,
                       top_k=args.top_k, capacity_factor=args.capacity_factor, activation=args.activation,
                       bias=not args.no_bias)
    dtype = DTYPES[args.dtype]
    autocast_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.autocast]
    layer = MoELayer(config).to(device="cuda", dtype=dtype)
    x_TD = torch.randn(args.tokens, config.model_dim, device="cuda", dtype=dtype, requires_grad=True)
    grad_TD = torch.randn(args.tokens, config.model_dim, device="cuda", dtype=autocast_dtype or dtype)

    def step():
        for p in list(layer.parameters()) + [x_TD]:
            p.grad = None
        with torch.autocast("cuda", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext():
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
