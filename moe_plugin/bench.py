"""Single-layer forward+backward timing: this layer, the bare expert GEMMs, the einsum reference and
DeepSpeed's MoE layer (when installed), interleaved in one run; medians and ratios.

Legend: T tokens, D model dim, H hidden, E experts, K top-k.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import torch

from .config import MoEConfig
from .layer import MoELayer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
BASELINE = "bare_gemm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dim", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--activation", default="relu", choices=["relu", "gelu", "silu"])
    parser.add_argument("--no-bias", action="store_true", help="experts without biases (like the bare GEMMs)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, each running every candidate once")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--skip", default="", help="comma-separated candidates to leave out: einsum,deepspeed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    config = MoEConfig(model_dim=args.model_dim, hidden_size=args.hidden_size, num_experts=args.num_experts,
                       top_k=args.top_k, capacity_factor=args.capacity_factor, activation=args.activation,
                       bias=not args.no_bias)
    skip = {name for name in args.skip.split(",") if name}
    layer = MoELayer(config).to(dtype)
    x_TD = torch.randn(args.tokens, config.model_dim, dtype=dtype)
    grad_TD = torch.randn_like(x_TD)

    candidates = {"moe_plugin": _layer_step(layer, x_TD, grad_TD), BASELINE: _bare_gemm_step(config, args.tokens, dtype)}
    notes = {}
    if "einsum" not in skip:
        from .reference import reference_moe
        candidates["einsum"] = _step(layer.parameters(), x_TD, grad_TD, lambda x: reference_moe(layer, x)[0])
        with torch.no_grad():
            notes["max_abs_diff_vs_einsum"] = float((layer(x_TD) - reference_moe(layer, x_TD)[0]).abs().max())
    if "deepspeed" not in skip:
        ds = _deepspeed_step(config, x_TD, grad_TD, dtype)
        if isinstance(ds, str):
            notes["deepspeed"] = ds
        else:
            candidates["deepspeed"] = ds

    times: Dict[str, List[float]] = {name: [] for name in candidates}
    for round_index in range(args.warmup + args.rounds):
        for name, step in candidates.items():
            seconds = step()
            if round_index >= args.warmup:
                times[name].append(seconds)
    median_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {
        "config": config.to_dict(), "tokens": args.tokens, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "rounds": args.rounds, "torch": torch.__version__,
        "median_ms": median_ms,
        "ratio_to_bare_gemm": {n: t / median_ms[BASELINE] for n, t in median_ms.items()},
        "ratio_to_moe_plugin": {n: t / median_ms["moe_plugin"] for n, t in median_ms.items()},
        "moe_plugin_stats": layer.stats, "notes": notes,
    }


def format_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"MoE layer forward+backward, {result['dtype']}, {result['threads']} threads, "
             f"T={result['tokens']} D={cfg['model_dim']} H={cfg['hidden_size']} E={cfg['num_experts']} "
             f"k={cfg['top_k']} cf={cfg['capacity_factor']} bias={cfg['bias']}, median of {result['rounds']} rounds",
             f"{'candidate':<12} {'median ms':>10} {'x bare_gemm':>12} {'x moe_plugin':>13}"]
    for name, ms in result["median_ms"].items():
        lines.append(f"{name:<12} {ms:>10.1f} {result['ratio_to_bare_gemm'][name]:>12.3f} "
                     f"{result['ratio_to_moe_plugin'][name]:>13.3f}")
    stats = result["moe_plugin_stats"]
    lines.append(f"moe_plugin: capacity {stats['capacity']}, dropped {stats['dropped_fraction']:.4f}")
    lines += [f"{key}: {value}" for key, value in result["notes"].items()]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def _step(params, x_TD: torch.Tensor, grad_TD: torch.Tensor, forward: Callable) -> Callable[[], float]:
    params = [p for p in params if p.requires_grad]
    x_TD = x_TD.detach().requires_grad_()

    def step() -> float:
        for p in params + [x_TD]:
            p.grad = None
        start = time.perf_counter()
        forward(x_TD).backward(grad_TD)
        return time.perf_counter() - start
    return step


def _layer_step(layer, x_TD, grad_TD):
    return _step(layer.parameters(), x_TD, grad_TD, layer)


def _bare_gemm_step(config: MoEConfig, tokens: int, dtype: torch.dtype) -> Callable[[], float]:
    """torch.bmm over [E, T*K/E, D] x [D, H], relu, x [H, D]: the balanced routed rows, nothing else."""
    E, D, H = config.num_experts, config.model_dim, config.hidden_size
    rows = max(1, tokens * config.top_k // E)
    w1_EDH = (torch.randn(E, D, H, dtype=dtype) / D ** 0.5).requires_grad_()
    w2_EHD = (torch.randn(E, H, D, dtype=dtype) / H ** 0.5).requires_grad_()
    x_ERD = torch.randn(E, rows, D, dtype=dtype)
    grad_ERD = torch.randn_like(x_ERD)
    return _step([w1_EDH, w2_EHD], x_ERD, grad_ERD, lambda x: torch.bmm(torch.relu(torch.bmm(x, w1_EDH)), w2_EHD))


def _deepspeed_step(config: MoEConfig, x_TD, grad_TD, dtype) -> "Callable[[], float] | str":
    try:
        from .baselines.deepspeed_moe import build_deepspeed_moe
        module = build_deepspeed_moe(config.model_dim, config.hidden_size, config.num_experts, config.top_k,
                                     config.capacity_factor, activation=config.activation, bias=config.bias,
                                     min_capacity=config.min_capacity)
    except ImportError as error:
        return f"skipped ({error})"
    except ValueError as error:
        return f"skipped (DeepSpeed cannot run this configuration: {error})"
    return _step(module.to(dtype).parameters(), x_TD, grad_TD, module)
