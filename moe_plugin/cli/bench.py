"""Single-layer forward+backward timing: this layer, the bare expert GEMMs, the einsum reference and
DeepSpeed's MoE layer (when installed), interleaved in one run; medians and ratios.

--autocast bf16|fp16 runs every candidate under torch.autocast (parameters in --dtype) and times the
bare GEMMs in the autocast dtype (the floor: no casts); --compile adds the torch.compile'd layer;
--device cuda times on the GPU (synchronized).

Floors, on the rows the layer itself keeps per expert in this run (its real, skewed routing): floor_gated, the
experts' GEMMs with the layer's own activation and matrix count (a gated activation: D x 2H in, activation,
H x D out) and nothing else; floor_relu, ReLU with one D x H matrix in (what the older floors ran, so a gated
layer measured against it looks 1.5x slower than it is). Grouped GEMMs: torch's F.grouped_mm autograd in bf16
on CUDA, the layer's own grouped GEMM op elsewhere. bare_gemm: torch.bmm on balanced rows, ReLU.
Throughput (tflops): forward+backward FLOPs 18*T*K*H*D for a gated activation and 12*T*K*H*D otherwise
(SonicMoE's convention); the ReLU floors count 12. peak_tflops: a dense n x n x n matmul in the GEMMs' dtype
in the same run (n 8192 on CUDA, 1024 on CPU), the machine's reachable peak.

Legend: T tokens, D model dim, H hidden, E experts, K top-k.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from .. import activations
from .deepspeed_moe import build_deepspeed_moe
from ..config import ACTIVATIONS, MoEConfig
from ..grouped_linear import grouped_linear
from ..layer import MoELayer
from ..reference import reference_moe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
SKIPPABLE = ("einsum", "deepspeed", "eager")
AT_LEAST = {"tokens": 1, "rounds": 1, "warmup": 0, "threads": 1}   # the flags MoEConfig does not check
# MoEConfig's fields set by flags: its errors name the flag instead
FLAGS = {"model_dim": "--model-dim", "hidden_size": "--hidden-size", "num_experts": "--num-experts",
         "top_k": "--top-k", "capacity_factor": "--capacity-factor", "activation": "--activation"}
BASELINE = "bare_gemm"
RELU_COUNTED = ("bare_gemm", "floor_relu")   # candidates that run one D x H matrix in, whatever the layer's activation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dim", type=int, default=1024, help="D, the model dim")
    parser.add_argument("--hidden-size", type=int, default=4096, help="H, each expert's hidden dim")
    parser.add_argument("--num-experts", type=int, default=8, help="E")
    parser.add_argument("--top-k", type=int, default=2, help="K, experts per token")
    parser.add_argument("--tokens", type=int, default=4096, help="T, tokens per call")
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="tokens an expert takes, per K*T/E; 0: dropless")
    parser.add_argument("--activation", default="relu",   # swiglu_oai needs a limit and alpha: not offered here
                        choices=[a for a in ACTIVATIONS if a != "swiglu_oai"], help="the experts' activation")
    parser.add_argument("--no-bias", action="store_true", help="experts without biases (like the bare GEMMs)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="parameters' (and input) dtype")
    parser.add_argument("--autocast", default="none", choices=["none", "bf16", "fp16"],
                        help="run under torch.autocast in this dtype; the bare GEMMs run in it")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(layer)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, each running every candidate once")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--skip", default="", help="comma-separated candidates to leave out: einsum,deepspeed,eager")
    parser.add_argument("--hf", action="store_true",
                        help="also time Hugging Face's Mixtral MoE block on its grouped_mm experts (swiglu, no bias, dropless)")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed of the weights and inputs")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def checked_config(args: argparse.Namespace) -> MoEConfig:
    """The layer's config from the flags, every flag checked; ValueError naming the flag, its value and what is
    allowed."""
    for name, least in AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ValueError(f"--{name}={value} is invalid: must be an integer >= {least}")
    unknown = sorted(set(filter(None, args.skip.split(","))) - set(SKIPPABLE))
    if unknown:
        raise ValueError(f"--skip={args.skip} is invalid: {', '.join(unknown)} is not a candidate; allowed: "
                         f"a comma-separated list of {', '.join(SKIPPABLE)}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={args.device} is invalid: must be cpu or cuda (or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={args.device} is invalid here: torch {torch.__version__} sees no CUDA GPU")
    try:
        return MoEConfig(model_dim=args.model_dim, hidden_size=args.hidden_size, num_experts=args.num_experts,
                         top_k=args.top_k, capacity_factor=args.capacity_factor, activation=args.activation,
                         bias=not args.no_bias)
    except (TypeError, ValueError) as error:
        fields = "|".join(FLAGS)
        raise ValueError(re.sub(rf"\b(MoEConfig\.)?({fields})\b", lambda m: FLAGS[m.group(2)], str(error))) from None


def run(args: argparse.Namespace) -> dict:
    config = checked_config(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    autocast_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.autocast]
    gemm_dtype = autocast_dtype or dtype
    skip = {name for name in args.skip.split(",") if name}
    layer = MoELayer(config).to(device=device, dtype=dtype)
    x_TD = torch.randn(args.tokens, config.model_dim, dtype=dtype, device=device)
    grad_TD = torch.randn(args.tokens, config.model_dim, dtype=gemm_dtype, device=device)

    def autocast():
        return torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()

    candidates, notes = {}, {}
    if "eager" not in skip:
        candidates["moe_plugin"] = _step(layer.parameters(), x_TD, grad_TD, layer, autocast)
    if args.compile:
        candidates["compiled"] = _step(layer.parameters(), x_TD, grad_TD, torch.compile(layer), autocast)
    candidates[BASELINE] = _bare_gemm_step(config, args.tokens, gemm_dtype, device)
    rows_E = _kept_rows_per_expert(layer, x_TD, autocast)
    candidates["floor_gated"] = _floor_step(config, rows_E, activations.of_config(config), gemm_dtype, device)
    candidates["floor_relu"] = _floor_step(config, rows_E, activations.Activation("relu"), gemm_dtype, device)
    if "einsum" not in skip:
        candidates["einsum"] = _step(layer.parameters(), x_TD, grad_TD, lambda x: reference_moe(layer, x)[0],
                                     autocast)
        with torch.no_grad(), autocast():
            notes["max_abs_diff_vs_einsum"] = float((layer(x_TD).float() - reference_moe(layer, x_TD)[0].float())
                                                    .abs().max())
    if args.hf:
        hf = _hf_step(config, x_TD, grad_TD, dtype, autocast)
        if isinstance(hf, str):
            notes["hf_grouped_mm"] = hf
        else:
            candidates["hf_grouped_mm"] = hf
    if "deepspeed" not in skip:
        ds = _deepspeed_step(config, x_TD, grad_TD, dtype, autocast)
        if isinstance(ds, str):
            notes["deepspeed"] = ds
        else:
            candidates["deepspeed"] = ds

    median_ms = interleaved_median_ms(candidates, args.warmup, args.rounds)
    ours = "moe_plugin" if "moe_plugin" in median_ms else "compiled"
    flops = {name: train_flops(config, args.tokens, gated=name not in RELU_COUNTED) for name in median_ms}
    return {
        "config": config.to_dict(), "tokens": args.tokens, "dtype": args.dtype, "autocast": args.autocast,
        "device": str(device), "threads": torch.get_num_threads(), "rounds": args.rounds, "torch": torch.__version__,
        "median_ms": median_ms,
        "ratio_to_bare_gemm": {n: t / median_ms[BASELINE] for n, t in median_ms.items()},
        "ratio_to_moe_plugin": {n: t / median_ms[ours] for n, t in median_ms.items()},
        "ratio_to_floor_gated": {n: t / median_ms["floor_gated"] for n, t in median_ms.items()},
        "tflops": {n: flops[n] / (t * 1e-3) / 1e12 for n, t in median_ms.items()},
        "peak_tflops": dense_matmul_tflops(gemm_dtype, device, args.rounds),
        "routed_rows_per_expert": rows_E,
        "moe_plugin_stats": layer.stats, "notes": notes,
    }


def train_flops(config: MoEConfig, tokens: int, gated: bool = True) -> int:
    """Forward+backward FLOPs of the experts: 18*T*K*H*D gated (3 matrices' worth), 12*T*K*H*D otherwise."""
    per_row = 18 if gated and activations.of_config(config).gated else 12
    return per_row * tokens * config.top_k * config.hidden_size * config.model_dim


def dense_matmul_tflops(dtype: torch.dtype, device: torch.device, rounds: int) -> float:
    """The best TFLOP/s of a dense n x n x n matmul (n 8192 on CUDA, 1024 elsewhere) over rounds + 1 tries."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(rounds + 1):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e12


def interleaved_median_ms(candidates: Dict[str, Callable[[], float]], warmup: int, rounds: int) -> Dict[str, float]:
    """Run the candidates' steps in turn, round after round; each one's median milliseconds after warmup."""
    times: Dict[str, List[float]] = {name: [] for name in candidates}
    for round_index in range(warmup + rounds):
        for name, step in candidates.items():
            seconds = step()
            if round_index >= warmup:
                times[name].append(seconds)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def format_table(result: dict) -> str:
    cfg = result["config"]
    amp = "" if result.get("autocast", "none") == "none" else f" under autocast {result['autocast']}"
    lines = [f"MoE layer forward+backward, {result['dtype']}{amp} on {result.get('device', 'cpu')}, "
             f"{result['threads']} threads, "
             f"T={result['tokens']} D={cfg['model_dim']} H={cfg['hidden_size']} E={cfg['num_experts']} "
             f"k={cfg['top_k']} cf={cfg['capacity_factor']} bias={cfg['bias']}, median of {result['rounds']} rounds",
             f"{'candidate':<13} {'median ms':>10} {'x bare_gemm':>12} {'x floor_gated':>14} {'x moe_plugin':>13} "
             f"{'TFLOP/s':>8}"]
    for name, ms in result["median_ms"].items():
        lines.append(f"{name:<13} {ms:>10.1f} {result['ratio_to_bare_gemm'][name]:>12.3f} "
                     f"{result['ratio_to_floor_gated'][name]:>14.3f} {result['ratio_to_moe_plugin'][name]:>13.3f} "
                     f"{result['tflops'][name]:>8.3f}")
    lines.append(f"dense matmul peak (same run): {result['peak_tflops']:.3f} TFLOP/s; FLOPs: 18*T*K*H*D gated, "
                 f"12*T*K*H*D otherwise (floor_relu and bare_gemm count 12)")
    stats = result["moe_plugin_stats"]
    lines.append(f"moe_plugin: capacity {stats['capacity']}, dropped {stats['dropped_fraction']:.4f}")
    lines += [f"{key}: {value}" for key, value in result["notes"].items()]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        checked_config(args)
    except ValueError as error:
        print(f"moe-plugin bench: {error}", file=sys.stderr)
        return 2
    result = run(args)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def _step(params, x_TD: torch.Tensor, grad_TD: torch.Tensor, forward: Callable,
          context: Callable = contextlib.nullcontext) -> Callable[[], float]:
    params = [p for p in params if p.requires_grad]
    x_TD = x_TD.detach().requires_grad_()
    sync = torch.cuda.synchronize if x_TD.is_cuda else (lambda: None)

    def step() -> float:
        for p in params + [x_TD]:
            p.grad = None
        sync()
        start = time.perf_counter()
        with context():
            y = forward(x_TD)
        y.backward(grad_TD.to(y.dtype))
        sync()
        return time.perf_counter() - start
    return step


def _bare_gemm_step(config: MoEConfig, tokens: int, dtype: torch.dtype, device=None) -> Callable[[], float]:
    """torch.bmm over [E, T*K/E, D] x [D, H], relu, x [H, D]: the balanced routed rows, nothing else."""
    E, D, H = config.num_experts, config.model_dim, config.hidden_size
    rows = max(1, tokens * config.top_k // E)
    w1_EDH = (torch.randn(E, D, H, dtype=dtype, device=device) / D ** 0.5).requires_grad_()
    w2_EHD = (torch.randn(E, H, D, dtype=dtype, device=device) / H ** 0.5).requires_grad_()
    x_ERD = torch.randn(E, rows, D, dtype=dtype, device=device)
    grad_ERD = torch.randn_like(x_ERD)
    return _step([w1_EDH, w2_EHD], x_ERD, grad_ERD, lambda x: torch.bmm(torch.relu(torch.bmm(x, w1_EDH)), w2_EHD))


def _kept_rows_per_expert(layer: MoELayer, x_TD: torch.Tensor, autocast: Callable) -> List[int]:
    """The rows the layer keeps per expert on x_TD (its real routing, capacity applied), from one forward."""
    with torch.no_grad(), autocast():
        layer(x_TD)
    stats = layer.stats
    return [min(load, stats["capacity"]) for load in stats["tokens_per_expert"]]


def _floor_step(config: MoEConfig, rows_E: List[int], activation: "activations.Activation", dtype: torch.dtype,
                device) -> Callable[[], float]:
    """The experts' grouped GEMMs alone on rows_E rows per expert: [R, D] x [D, first width], activation,
    x [H, D]; F.grouped_mm's own autograd in bf16 on CUDA, the layer's grouped GEMM op elsewhere."""
    E, D, H = config.num_experts, config.model_dim, config.hidden_size
    offs_E = torch.tensor(rows_E, device=device).cumsum(0).to(torch.int32)
    w1_EDF = (torch.randn(E, D, activations.first_width(activation, H), dtype=dtype, device=device) / D ** 0.5)
    w2_EHD = (torch.randn(E, H, D, dtype=dtype, device=device) / H ** 0.5).requires_grad_()
    w1_EDF.requires_grad_()
    x_RD = torch.randn(sum(rows_E), D, dtype=dtype, device=device)
    grad_RD = torch.randn_like(x_RD)
    if device.type == "cuda" and dtype == torch.bfloat16:
        grouped = lambda x, w: torch.nn.functional.grouped_mm(x, w, offs=offs_E)   # noqa: E731
    else:
        grouped = lambda x, w: grouped_linear(x, w, offs_E)   # noqa: E731
    return _step([w1_EDF, w2_EHD], x_RD, grad_RD,
                 lambda x: grouped(activations.forward(grouped(x, w1_EDF), activation), w2_EHD))


def _hf_step(config: MoEConfig, x_TD, grad_TD, dtype, context) -> "Callable[[], float] | str":
    """transformers' MixtralSparseMoeBlock with config._experts_implementation = "grouped_mm"."""
    try:
        from ..integrations.transformers.torchaudio_guard import hide_unloadable_torchaudio  # imports transformers
        hide_unloadable_torchaudio()   # fairseq's torchaudio cannot load beside torch 2.13 and breaks HF's imports
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except (ImportError, OSError) as error:
        return f"skipped (transformers: {error})"
    hf_config = MixtralConfig(hidden_size=config.model_dim, intermediate_size=config.hidden_size,
                              num_local_experts=config.num_experts, num_experts_per_tok=config.top_k)
    hf_config._experts_implementation = "grouped_mm"
    try:
        block = MixtralSparseMoeBlock(hf_config).to(device=x_TD.device, dtype=dtype)
    except (TypeError, ValueError, AttributeError) as error:
        return f"skipped (transformers {type(error).__name__}: {error})"
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)

    def forward(x):
        out = block(x.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).squeeze(0)
    return _step(block.parameters(), x_TD, grad_TD, forward, context)


def _deepspeed_step(config: MoEConfig, x_TD, grad_TD, dtype,
                    context: Callable = contextlib.nullcontext) -> "Callable[[], float] | str":
    try:
        module = build_deepspeed_moe(config.model_dim, config.hidden_size, config.num_experts, config.top_k,
                                     config.capacity_factor, activation=config.activation, bias=config.bias,
                                     min_capacity=config.min_capacity)
    except ImportError as error:
        return f"skipped ({error})"
    except ValueError as error:
        return f"skipped (DeepSpeed cannot run this configuration: {error})"
    return _step(module.to(device=x_TD.device, dtype=dtype).parameters(), x_TD, grad_TD, module, context)
