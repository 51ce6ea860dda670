"""MoEConfig.recompute (issue 45): the bytes one MoE layer keeps for backward in each mode against its peers, and the
forward+backward time it costs, in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_recompute.py --threads 1 [--dtype bf16] [--json FILE]

Bytes: a forward+backward at a Mixtral-like shape (Mixtral-8x7B's D 4096 and H 14336 divided by --shrink, same
H/D ratio; E 8, top-2, SwiGLU, no biases), counted by saved-tensor hooks: every storage once, parameters not
counted, the layer's input included (each layer keeps it one way or another). Rows:
  moe_plugin none / experts        our layer, dropless and at capacity factor 1.25
  hf_grouped_mm                    transformers' MixtralSparseMoeBlock on grouped_mm (dropless)
  deepspeed                        deepspeed.moe.layer.MoE with SwiGLU experts, capacity factor 1.25
  tutel                            tutel.moe.moe_layer, llama_ffn experts, capacity factor 1.25 and 0 (dropless)
A peer that cannot import or run gets its reason instead. Time: our layer's step in each mode at --time-shape,
interleaved round by round, medians and the experts/none ratio (issue 45's target: at most 1.25x).

Legend: T tokens, D model dim, H expert hidden dim, E experts, K top-k.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import moe_plugin.integrations.transformers  # noqa: F401  (hides an unloadable torchaudio before transformers loads)
from moe_plugin import MoEConfig, MoELayer
from moe_plugin.plan.state_bytes import saved_for_backward

MIXTRAL = dict(model_dim=4096, hidden_size=14336, num_experts=8, top_k=2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def saved_bytes(module: torch.nn.Module, x_TD: torch.Tensor, forward) -> int:
    """What forward(x_TD) keeps for backward (then runs the backward, so that every saved tensor was needed)."""
    x_TD = x_TD.detach().requires_grad_()
    total = {}
    with saved_for_backward(module, total):
        y_TD = forward(x_TD)
    y_TD.float().sum().backward()
    return total["bytes"]


def ours(config: MoEConfig, dtype):
    layer = MoELayer(config).to(dtype)
    return layer, layer


def hf_block(config: MoEConfig, dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    hf_config = MixtralConfig(hidden_size=config.model_dim, intermediate_size=config.hidden_size,
                              num_local_experts=config.num_experts, num_experts_per_tok=config.top_k)
    hf_config._experts_implementation = "grouped_mm"
    block = MixtralSparseMoeBlock(hf_config).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)

    def forward(x_TD):
        out = block(x_TD.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).squeeze(0)
    return block, forward


def deepspeed_moe(config: MoEConfig, dtype):
    from moe_plugin.cli.deepspeed_moe import build_deepspeed_moe
    module = build_deepspeed_moe(config.model_dim, config.hidden_size, config.num_experts, config.top_k,
                                 config.capacity_factor, activation="swiglu", bias=False, min_capacity=0).to(dtype)
    return module, module


def tutel_layer(config: MoEConfig, dtype):
    from tutel import moe as tutel_moe
    experts = {"type": "llama_ffn", "count_per_node": config.num_experts, "hidden_size_per_expert": config.hidden_size}
    gate = {"type": "top", "k": config.top_k, "capacity_factor": config.capacity_factor, "fp32_gate": True}
    module = tutel_moe.moe_layer(gate_type=gate, model_dim=config.model_dim, experts=experts).to(dtype)

    def forward(x_TD):
        return module(x_TD.unsqueeze(0)).squeeze(0)
    return module, forward


def bytes_table(args, dtype) -> dict:
    shape = {**MIXTRAL, "model_dim": MIXTRAL["model_dim"] // args.shrink,
             "hidden_size": MIXTRAL["hidden_size"] // args.shrink}
    base = dict(shape, activation="swiglu", bias=False, min_capacity=0)
    x_TD = torch.randn(args.tokens, shape["model_dim"], dtype=dtype)
    rows = {}
    candidates = [(f"moe_plugin {mode}, {name}", ours, dict(base, capacity_factor=cf, recompute=mode))
                  for name, cf in (("dropless", 0.0), ("cf 1.25", 1.25)) for mode in ("none", "experts")]
    candidates += [("hf_grouped_mm, dropless", hf_block, dict(base, capacity_factor=0.0)),
                   ("deepspeed, cf 1.25", deepspeed_moe, dict(base, capacity_factor=1.25)),
                   ("tutel, cf 1.25", tutel_layer, dict(base, capacity_factor=1.25)),
                   ("tutel, dropless", tutel_layer, dict(base, capacity_factor=0.0))]
    for name, build, values in candidates:
        torch.manual_seed(0)
        try:
            module, forward = build(MoEConfig(**values), dtype)
            rows[name] = saved_bytes(module, x_TD, forward)
        except Exception as error:      # a peer that cannot import or run here: its row says why
            rows[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        module = forward = None
    return {"shape": {"tokens": args.tokens, **shape}, "bytes": rows}


def step_times(args, dtype) -> dict:
    T, D, H = (int(v) for v in args.time_shape.split(","))
    x_TD = torch.randn(T, D, dtype=dtype)
    grad_TD = torch.randn_like(x_TD)
    layers = {}
    for mode in ("none", "experts"):
        torch.manual_seed(0)
        layers[mode] = MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=8, top_k=2, capacity_factor=0.0,
                                          activation="swiglu", bias=False, recompute=mode)).to(dtype)
    times = {mode: [] for mode in layers}
    for round_index in range(args.rounds + 1):
        for mode, layer in layers.items():
            x = x_TD.detach().requires_grad_()
            start = time.perf_counter()
            layer(x).backward(grad_TD)
            if round_index:      # the first round warms up
                times[mode].append(time.perf_counter() - start)
    ms = {mode: 1e3 * statistics.median(values) for mode, values in times.items()}
    return {"shape": {"tokens": T, "model_dim": D, "hidden_size": H, "num_experts": 8, "top_k": 2},
            "rounds": args.rounds, "median_ms": ms, "experts_over_none": ms["experts"] / ms["none"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--shrink", type=int, default=4, help="Mixtral's D and H divided by this (default 4)")
    parser.add_argument("--time-shape", default="2048,512,1792", help="T,D,H of the timed steps")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "saved": bytes_table(args, dtype), "time": step_times(args, dtype)}
    rows = result["saved"]["bytes"]
    none, hf = rows["moe_plugin none, dropless"], rows.get("hf_grouped_mm, dropless")
    print(f"bytes kept for backward by one MoE layer, {args.dtype}, shape {result['saved']['shape']}")
    print(f"{'':<34} {'MB':>10} {'/ ours none':>12} {'/ HF block':>11}")
    for name, value in rows.items():
        if isinstance(value, str):
            print(f"{name:<34} {value}")
            continue
        to_hf = f"{value / hf:>11.3f}" if isinstance(hf, int) else f"{'-':>11}"
        print(f"{name:<34} {value / 1e6:>10.2f} {value / none:>12.3f} {to_hf}")
    timed = result["time"]
    print(f"forward+backward, {args.dtype}, {timed['shape']}, median of {timed['rounds']} rounds: none "
          f"{timed['median_ms']['none']:.1f} ms, experts {timed['median_ms']['experts']:.1f} ms, experts/none "
          f"{timed['experts_over_none']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
