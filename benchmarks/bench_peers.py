"""Our layer against its peers, forward+backward, at three shapes in one run (issue 34 item 4).

    python benchmarks/bench_peers.py --device cuda [--shapes default,hf,sonic] [--compile] [--json FILE]
    python benchmarks/bench_peers.py --smoke           # CPU, two tiny shapes: every row, timed or with its reason

Shapes: default (T 4096, D 1024, H 4096, E 8, top-2, ReLU with biases, capacity 1.25), hf (T 16384, D 2048,
H 1408, E 64, top-6, dropless SwiGLU), sonic (SonicMoE's T 24576, D 1536, H 256, E 128, top-8, dropless SwiGLU);
bf16 parameters on the GPU. Candidates, interleaved round by round (moe_plugin/cli/bench.py's timing):
  moe_plugin            our layer, eager
  moe_plugin_graphed    the same step captured as one CUDA graph and replayed (benchmarks/gpu/graph_step.py)
  moe_plugin_compiled   torch.compile(layer) (--compile: tens of seconds per shape)
  moe_plugin_fp32_amp   fp32 parameters under bf16 autocast, weight casts included (default shape only)
  floor_gated           the experts' grouped GEMMs alone with the layer's activation on its routed rows
  floor_relu            the same with ReLU and one D x H matrix in (the older floor)
  hf_grouped_mm         transformers' MixtralSparseMoeBlock on grouped_mm (SwiGLU, no bias, dropless only)
  deepspeed             deepspeed.moe.layer.MoE, one process (needs a capacity: no dropless mode)
  tutel                 tutel.moe.moe_layer (ffn, or llama_ffn for SwiGLU; capacity_factor 0 is its dropless)
  moe_plugin_tutel      our Tutel drop-in, moe_plugin.tutel.moe_layer, with the tutel row's arguments (issue 43)
  einsum_fairseq        the GShard/fairseq-style dense one-hot einsum MoE (moe_plugin/reference.py) at capacity
                        1.25 (the seed's setting, that of Tutel's "x over fairseq"), where its T x E x C masks
                        fit (the default shape; not the HF or SonicMoE shape: ~80 and ~240 GB)
A peer that cannot import, build or run the shape gets a row with the reason; the run goes on.
TFLOP/s: 18*T*K*H*D forward+backward for gated experts, 12*T*K*H*D otherwise (floor_relu counts 12).

Legend: T tokens, D model dim, H hidden, E experts, K top-k, C capacity per expert.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import moe_plugin.integrations.transformers  # noqa: E402,F401  (hides an unloadable torchaudio first)
from moe_plugin import MoEConfig, MoELayer, activations  # noqa: E402
from moe_plugin.cli import bench  # noqa: E402
from moe_plugin.reference import reference_moe  # noqa: E402

SHAPES = {
    "default": dict(tokens=4096, model_dim=1024, hidden_size=4096, num_experts=8, top_k=2, activation="relu",
                    bias=True, capacity_factor=1.25),
    "hf": dict(tokens=16384, model_dim=2048, hidden_size=1408, num_experts=64, top_k=6, activation="swiglu",
               bias=False, capacity_factor=0.0),
    "sonic": dict(tokens=24576, model_dim=1536, hidden_size=256, num_experts=128, top_k=8, activation="swiglu",
                  bias=False, capacity_factor=0.0),
    # --smoke (CPU): the two kinds of row at a tiny size
    "tiny_relu": dict(tokens=64, model_dim=32, hidden_size=48, num_experts=4, top_k=2, activation="relu", bias=True,
                      capacity_factor=1.25),
    "tiny_swiglu": dict(tokens=64, model_dim=32, hidden_size=24, num_experts=8, top_k=3, activation="swiglu",
                        bias=False, capacity_factor=0.0),
}
CANDIDATES = ("moe_plugin", "moe_plugin_graphed", "moe_plugin_compiled", "moe_plugin_fp32_amp", "floor_gated",
              "floor_relu", "hf_grouped_mm", "deepspeed", "tutel", "moe_plugin_tutel", "einsum_fairseq")
EINSUM_CAPACITY_FACTOR = 1.25
# the einsum MoE keeps about K + 4 fp32 T x E x C tensors for backward (moe_plugin/reference.py): 1 GB at the default
# shape, ~80 GB at the HF shape, ~240 GB at SonicMoE's
EINSUM_MAX_BYTES = 24e9


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="default,hf,sonic", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny shapes, one round")
    parser.add_argument("--compile", action="store_true", help="also torch.compile(layer) (slow to build)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated candidates to run (default: all)")
    parser.add_argument("--json", default=None, help="also write the results to this file (after each shape)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.shapes, args.rounds, args.warmup = "cpu", "tiny_relu,tiny_swiglu", 1, 0
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    unknown = [c for c in args.only.split(",") if c and c not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidates {unknown} in --only; known: {', '.join(CANDIDATES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "rounds": args.rounds,
              "peak_tflops": bench.dense_matmul_tflops(dtype, device, 3), "shapes": {}}
    for name in args.shapes.split(","):    # written shape by shape: a run stopped at its time limit keeps the rest
        result["shapes"][name] = run_shape(name, SHAPES[name], device, dtype, args)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        print(format_table({**result, "shapes": {name: result["shapes"][name]}}), flush=True)
    return 0


def run_shape(name, shape, device, dtype, args) -> dict:
    torch.manual_seed(0)
    shape = dict(shape)
    T = shape.pop("tokens")
    config = MoEConfig(**shape)
    layer = MoELayer(config).to(device=device, dtype=dtype)
    x_TD = torch.randn(T, config.model_dim, device=device, dtype=dtype)
    grad_TD = torch.randn_like(x_TD)
    nothing = contextlib.nullcontext
    builders = {
        "moe_plugin": lambda: bench._step(layer.parameters(), x_TD, grad_TD, layer),
        "moe_plugin_graphed": lambda: graphed(layer, x_TD, grad_TD),
        "moe_plugin_compiled": lambda: (bench._step(layer.parameters(), x_TD, grad_TD, torch.compile(layer))
                                        if args.compile else "not run (--compile builds it: tens of seconds a shape)"),
        "moe_plugin_fp32_amp": lambda: fp32_autocast(config, x_TD, grad_TD) if name == "default" else
        "default shape only",
        "floor_gated": lambda: bench._floor_step(config, rows_E, activations.of_config(config), dtype, device),
        "floor_relu": lambda: bench._floor_step(config, rows_E, activations.Activation("relu"), dtype, device),
        "hf_grouped_mm": lambda: hf_block(config, x_TD, grad_TD, dtype, nothing),
        "deepspeed": lambda: bench._deepspeed_step(config, x_TD, grad_TD, dtype, nothing),
        "tutel": lambda: tutel_step(config, x_TD, grad_TD),
        "moe_plugin_tutel": lambda: tutel_step(config, x_TD, grad_TD, drop_in=True),
        "einsum_fairseq": lambda: einsum_step(shape, T, x_TD, grad_TD, device, dtype),
    }
    assert tuple(builders) == CANDIDATES
    if args.only:
        builders = {c: b for c, b in builders.items() if c in args.only.split(",")}
    rows_E = bench._kept_rows_per_expert(layer, x_TD, nothing)
    steps, reasons = {}, {}
    # the CUDA-graph capture last: a capture that fails leaves the process's CUDA state unusable for what follows
    for candidate, build in sorted(builders.items(), key=lambda item: item[0] == "moe_plugin_graphed"):
        try:
            made = build()
            if not isinstance(made, str):
                made()                # one untimed call: builds lazy state, and fails here rather than mid-run
        except Exception as error:    # a peer that cannot run this shape: its row says why, the others go on
            made = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if isinstance(made, str):
            reasons[candidate] = made
        else:
            steps[candidate] = made
    median_ms = bench.interleaved_median_ms(steps, args.warmup, args.rounds)
    flops = {n: bench.train_flops(config, T, gated=n not in bench.RELU_COUNTED) for n in median_ms}
    floor = median_ms.get("floor_gated")
    ours = median_ms.get("moe_plugin")
    return {"config": {"tokens": T, **shape}, "median_ms": median_ms, "reasons": reasons,
            "routed_rows_per_expert": rows_E,
            "ratio_to_floor_gated": {n: t / floor for n, t in median_ms.items()} if floor else {},
            "ratio_to_moe_plugin": {n: t / ours for n, t in median_ms.items()} if ours else {},
            "tflops": {n: flops[n] / (t * 1e-3) / 1e12 for n, t in median_ms.items()}}


def graphed(layer, x_TD, grad_TD):
    if x_TD.device.type != "cuda":
        return "CUDA graphs need a GPU"
    from graph_step import GraphedStep
    return GraphedStep(lambda x: (layer(x), layer.aux_loss), layer.parameters(), x_TD,
                       [grad_TD, torch.ones((), device=x_TD.device)]).step


def fp32_autocast(config, x_TD, grad_TD):
    """Our layer with fp32 parameters under bf16 autocast (issue 34: <= 1.25x the floor plus the weight casts)."""
    if x_TD.device.type != "cuda":
        return "bf16 autocast with fp32 parameters: GPU only"
    layer = MoELayer(config).to(device=x_TD.device)
    return bench._step(layer.parameters(), x_TD.float(), grad_TD, layer,
                       lambda: torch.autocast("cuda", dtype=torch.bfloat16))


def hf_block(config, x_TD, grad_TD, dtype, context):
    if config.activation != "swiglu" or config.bias or config.capacity_factor != 0:
        return "not this layer: HF's Mixtral block is SwiGLU without biases, dropless"
    return bench._hf_step(config, x_TD, grad_TD, dtype, context)


def tutel_step(config, x_TD, grad_TD, drop_in=False):
    """tutel.moe.moe_layer with the same experts, gate and capacity (0: Tutel's dynamic, dropless capacity); drop_in:
    our moe_plugin.tutel.moe_layer with the same arguments."""
    try:
        if drop_in:
            from moe_plugin import tutel as tutel_moe
        else:
            from tutel import moe as tutel_moe
    except Exception as error:    # not installed, or its extension failed to load
        return f"skipped (tutel: {type(error).__name__}: {error})"
    if config.activation == "swiglu" and not config.bias:
        experts = {"type": "llama_ffn", "count_per_node": config.num_experts,
                   "hidden_size_per_expert": config.hidden_size}
    elif config.activation == "relu":
        experts = {"type": "ffn", "count_per_node": config.num_experts, "hidden_size_per_expert": config.hidden_size,
                   "activation_fn": torch.nn.functional.relu, "has_fc1_bias": config.bias,
                   "has_fc2_bias": config.bias}
    else:
        return f"Tutel has no {config.activation} expert with bias={config.bias}"
    if x_TD.device.type == "cpu" and not drop_in and not _tutel_has_cpu_kernels():
        return "Tutel built without its C++ extension: no CPU kernels here (the GPU script builds it)"
    gate = {"type": "top", "k": config.top_k, "capacity_factor": config.capacity_factor, "fp32_gate": True}
    module = tutel_moe.moe_layer(gate_type=gate, model_dim=config.model_dim, experts=experts)
    module = module.to(device=x_TD.device, dtype=x_TD.dtype)

    def forward(x):
        return module(x.unsqueeze(0)).squeeze(0)
    return bench._step(module.parameters(), x_TD, grad_TD, forward)


def _tutel_has_cpu_kernels() -> bool:
    try:
        import tutel_custom_kernel
        return hasattr(tutel_custom_kernel, "invoke_cpu_fp32")
    except ImportError:
        return False


def einsum_step(shape, T, x_TD, grad_TD, device, dtype):
    """The dense one-hot einsum MoE at capacity 1.25 (fairseq's and GShard's form), where its masks fit."""
    config = MoEConfig(**{**shape, "capacity_factor": EINSUM_CAPACITY_FACTOR})
    C = -(-config.top_k * EINSUM_CAPACITY_FACTOR * T // config.num_experts)
    need = T * config.num_experts * C * (config.top_k + 4) * 4
    if need > EINSUM_MAX_BYTES:
        return (f"not run: its T x E x C masks ({T * config.num_experts * C:.1e} elements) need ~{need / 1e9:.0f} GB "
                f"for backward (cap {EINSUM_MAX_BYTES / 1e9:.0f}): the O(T*E*C) dense dispatch does not fit this shape")
    layer = MoELayer(config).to(device=device, dtype=dtype)
    return bench._step(layer.parameters(), x_TD, grad_TD, lambda x: reference_moe(layer, x)[0])


def format_table(result: dict) -> str:
    lines = [f"peers, forward+backward per layer call, {result['dtype']} on {result['device']}, torch "
             f"{result['torch']}, median of {result['rounds']} interleaved rounds; dense matmul peak "
             f"{result['peak_tflops']:.1f} TFLOP/s (same run)"]
    for name, shape in result["shapes"].items():
        c = shape["config"]
        lines.append(f"\n{name}: T {c['tokens']}, D {c['model_dim']}, H {c['hidden_size']}, E {c['num_experts']}, "
                     f"top-{c['top_k']}, {c['activation']}, bias {c['bias']}, capacity factor {c['capacity_factor']}")
        lines.append(f"{'candidate':22s} {'ms':>9s} {'x floor_gated':>13s} {'x moe_plugin':>12s} {'TFLOP/s':>8s}")
        for cand, ms in shape["median_ms"].items():
            lines.append(f"{cand:22s} {ms:9.3f} {shape['ratio_to_floor_gated'].get(cand, float('nan')):13.3f} "
                         f"{shape['ratio_to_moe_plugin'].get(cand, float('nan')):12.3f} {shape['tflops'][cand]:8.1f}")
        for cand, reason in shape["reasons"].items():
            lines.append(f"{cand:22s} {'-':>9s}  {reason}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
