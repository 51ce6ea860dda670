"""The fused grouped GEMMs (moe_plugin/ops/triton_grouped.py, issue 34 item 3) against what each replaces, at
bench_peers.py's three shapes in bf16, one kernel at a time (ops/fused_gemms.py's timing: CUDA events, the median of
--rounds runs after a warm-up run, which compiles and autotunes):

  gather_up     x's routed rows read by index, bias and activation in the epilogue
                vs scatter_rows + grouped_mm (bias) + the activation
  dgrad_swiglu  (SwiGLU shapes) the down projection's dgrad with SwiGLU's backward, the gate scale and the gate
                gradient's row sums in the epilogue  vs  grouped_mm + the one-pass scaled SwiGLU backward
  wgrad_gather  the first projection's weight gradient (and the bias's) reading x's rows by index
                vs scatter_rows + grouped_mm (+ grouped_sum)

Each row also gives the fused result's largest difference from the unfused one, relative to the latter's largest
magnitude (the compiled kernels checked on the GPU's own numbers). fused/unfused < 1 is where the layer takes the
kernel (it measures the same way at its first step of each shape).

    python benchmarks/gpu/fused_kernels.py [--shapes default,hf,sonic] [--rounds 7] [--json FILE]
    python benchmarks/gpu/fused_kernels.py --smoke     # CPU, the Triton interpreter, a tiny shape: the script runs

Legend: T tokens, D model dim, H hidden, E experts, K top-k, R routed rows, F the first projection's width.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

SHAPES = {   # bench_peers.py's: (T, D, H, E, K, activation, bias)
    "default": (4096, 1024, 4096, 8, 2, "relu", True),
    "hf": (16384, 2048, 1408, 64, 6, "swiglu", False),
    "sonic": (24576, 1536, 256, 128, 8, "swiglu", False),
    "tiny": (37, 24, 20, 5, 3, "swiglu", True),      # --smoke
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="default,hf,sonic", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the results to this file (after each shape)")
    parser.add_argument("--smoke", action="store_true", help="CPU, the Triton interpreter, the tiny shape, 1 round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.rounds = "tiny", 1
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    return args


def difference(fused, unfused) -> float:
    """max |fused - unfused| / max |unfused| over the tensors the two return (None where both give None)."""
    worst = 0.0
    for a, b in zip(fused, unfused):
        if a is None and b is None:
            continue
        scale = float(b.double().abs().max()) if b.numel() else 0.0
        worst = max(worst, float((a.double() - b.double()).abs().max()) / max(scale, 1e-30) if b.numel() else 0.0)
    return worst


def run_shape(T, D, H, E, K, activation, bias, device, rounds) -> list:
    from moe_plugin import ops
    from moe_plugin.dispatch import plan_routes
    from moe_plugin.ops import fused_gemms, torch_grouped, triton_grouped
    dtype = torch.bfloat16
    fused_gemms.REPEATS = rounds
    gated = activation != "relu"
    F = 2 * H if gated else H
    plan = plan_routes(torch.rand(T, E).argsort(dim=1)[:, :K], E, 0.0, 0)      # dropless, random experts
    pos_TK, offs_E, R = plan.pos_TK.to(device), plan.offs_E.to(device=device, dtype=torch.int32), plan.num_rows
    token_R = torch_grouped.tokens_of_rows(pos_TK, R)
    x_TD = torch.randn(T, D, dtype=dtype, device=device)
    w1_EDF = (torch.randn(E, D, F, device=device) / D ** 0.5).to(dtype)
    b1_EF = torch.randn(E, F, dtype=dtype, device=device) if bias else None
    w2_EHD = (torch.randn(E, H, D, device=device) / H ** 0.5).to(dtype)
    grad_RD = torch.randn(R, D, dtype=dtype, device=device)
    grad_RF = torch.randn(R, F, dtype=dtype, device=device)
    pre_RF = torch.randn(R, F, dtype=dtype, device=device)
    gate_R1 = torch.rand(R, 1, dtype=dtype, device=device)

    def gather_rows():
        return ops.scatter_rows(x_TD, pos_TK, None, None, R)[0]

    def unfused_up():
        pre = ops.grouped_mm(gather_rows(), w1_EDF, offs_E, b1_EF)
        if activation == "relu":     # relu keeps its output for backward
            act = pre.relu_()
            return act, act
        return ops.swiglu(pre), pre

    def fused_dgrad():      # (scaled grad of the pre-activation, act, gate gradient's row sums)
        return triton_grouped.dgrad_swiglu(grad_RD, offs_E, w2_EHD, pre_RF, gate_R1)

    def unfused_dgrad():
        grad_act_RH = ops.grouped_mm(grad_RD, w2_EHD.transpose(1, 2), offs_E)
        act_RH, grad_pre_RF, dot_R = fused_gemms.activation_backward_scaled(pre_RF, grad_act_RH, "swiglu", gate_R1)
        return grad_pre_RF, act_RH, dot_R

    kernels = {"gather_up": (lambda: triton_grouped.gather_up(x_TD, token_R, offs_E, w1_EDF, b1_EF, activation),
                             unfused_up)}
    if activation == "swiglu":
        kernels["dgrad_swiglu"] = (fused_dgrad, unfused_dgrad)
    kernels["wgrad_gather"] = (
        lambda: triton_grouped.wgrad_gather(x_TD, token_R, offs_E, grad_RF, w1_EDF, bias),
        lambda: (ops.grouped_mm(gather_rows().t(), grad_RF, offs_E),
                 ops.grouped_sum(grad_RF, offs_E) if bias else None))
    rows = []
    for name, (fused, unfused) in kernels.items():
        try:
            fused_ms = 1e3 * fused_gemms.seconds(fused, device)
            unfused_ms = 1e3 * fused_gemms.seconds(unfused, device)
            rows.append(dict(kernel=name, fused_ms=fused_ms, unfused_ms=unfused_ms, ratio=fused_ms / unfused_ms,
                             difference=difference(fused(), unfused())))
        except Exception as error:      # a kernel that fails to build or run here: its row says why, the rest runs
            rows.append(dict(kernel=name, error=f"{type(error).__name__}: {error}"[:300]))
        print(name, rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("fused_kernels.py times Triton kernels on a GPU: no CUDA device is available (--smoke runs them on CPU "
              "under the Triton interpreter)", file=sys.stderr)
        return 2
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"      # read once, when triton is first imported (below)
    from moe_plugin.ops import choice
    device = torch.device("cpu" if args.smoke else "cuda")
    result = {"device": "cpu (Triton interpreter)" if args.smoke else torch.cuda.get_device_name(),
              "torch": torch.__version__, "dtype": "bf16", "rounds": args.rounds, "shapes": {}}
    for name in args.shapes.split(","):
        torch.manual_seed(0)
        T, D, H, E, K, activation, bias = SHAPES[name]
        with choice.simulated_cuda() if args.smoke else torch.no_grad():
            rows = run_shape(T, D, H, E, K, activation, bias, device, args.rounds)
        result["shapes"][name] = dict(tokens=T, model_dim=D, hidden_size=H, num_experts=E, top_k=K,
                                      activation=activation, bias=bias, kernels=rows)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name, shape in result["shapes"].items():
        for row in shape["kernels"]:
            print(f"{name:<8} {row['kernel']:<13} " + (f"fused {row['fused_ms']:8.3f} ms  unfused {row['unfused_ms']:8.3f}"
                  f" ms  fused/unfused {row['ratio']:.3f}  difference {row['difference']:.1e}" if "error" not in row
                  else row["error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
