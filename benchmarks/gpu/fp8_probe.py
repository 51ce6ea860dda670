"""fp8 probe (issue 34 item 5): torch._scaled_grouped_mm (rowwise e4m3, bf16 out) against bf16 grouped_mm at the
GEMM sizes of bench_peers.py's three shapes, the quantization of both operands included.

    python benchmarks/gpu/fp8_probe.py [--json FILE]

Per shape: the up-projection [R, D] x [E, D, F] (F = 2H gated, H otherwise) and the down-projection [R, H] x
[E, H, D], R = T*K rows in balanced groups (rounded to 16, as the fp8 kernel needs). The fp8 time counts the
rowwise scaling of the activations and of the weights (weights change every training step) and the GEMM.
Plausibility of a >= 1.3x layer speedup: fp8 for the forward and the dgrad GEMMs (2/3 of the experts' FLOPs),
bf16 weight gradients, so even a layer made of GEMMs alone speeds up by 1 / (1/3 + (2/3) / r) for a GEMM
speedup r; a layer at f x its gated floor gains less (bench_peers.py gives f; the summary combines them).

Legend: T tokens, D model dim, H hidden, E experts, K top-k, R routed rows, F first GEMM's width.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {   # bench_peers.py's: (T, D, H, E, K, gated)
    "default": (4096, 1024, 4096, 8, 2, False),
    "hf": (16384, 2048, 1408, 64, 6, True),
    "sonic": (24576, 1536, 256, 128, 8, True),
}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def rowwise(t: torch.Tensor, dim: int):
    """(t scaled into e4m3 along dim's rows, the fp32 scales to multiply back)."""
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp_(min=1e-12)
    scale = amax / FP8_MAX
    return (t / scale).to(FP8), scale.squeeze(dim)


def fp8_grouped(x_RD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """x @ w per group in e4m3 with rowwise scales (x's per row, w's per output column), bf16 out."""
    xq_RD, sx_R = rowwise(x_RD, 1)
    wq_EFD, sw_EF = rowwise(w_EDF.transpose(-2, -1), 2)      # [E, F, D] contiguous: the kernel's column-major B
    return torch._scaled_grouped_mm(xq_RD, wq_EFD.contiguous().transpose(-2, -1), sx_R, sw_EF, offs=offs_E,
                                    out_dtype=torch.bfloat16)


def time_ms(fn, warmup=5, reps=20) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def probe(T, D, H, E, K, gated) -> dict:
    rows_per_group = (T * K // E) // 16 * 16
    R = rows_per_group * E
    offs_E = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * rows_per_group
    out = {}
    for name, (K_in, N_out) in {"up": (D, 2 * H if gated else H), "down": (H, D)}.items():
        x_RK = torch.randn(R, K_in, device="cuda", dtype=torch.bfloat16)
        w_EKN = torch.randn(E, K_in, N_out, device="cuda", dtype=torch.bfloat16) / K_in ** 0.5
        ref = F.grouped_mm(x_RK, w_EKN, offs=offs_E)
        got = fp8_grouped(x_RK, w_EKN, offs_E)
        error = float((got.float() - ref.float()).norm() / ref.float().norm())
        bf16_ms = time_ms(lambda: F.grouped_mm(x_RK, w_EKN, offs=offs_E))
        fp8_ms = time_ms(lambda: fp8_grouped(x_RK, w_EKN, offs_E))
        xq, sx = rowwise(x_RK, 1)
        wq, sw = rowwise(w_EKN.transpose(-2, -1), 2)
        wq = wq.contiguous()
        gemm_only_ms = time_ms(lambda: torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), sx, sw, offs=offs_E,
                                                                out_dtype=torch.bfloat16))
        out[name] = dict(rows=R, k=K_in, n=N_out, bf16_ms=bf16_ms, fp8_ms=fp8_ms, fp8_gemm_only_ms=gemm_only_ms,
                         relative_error=error)
    bf16 = sum(v["bf16_ms"] for v in out.values())
    fp8 = sum(v["fp8_ms"] for v in out.values())
    r = bf16 / fp8
    out["gemm_speedup"] = r
    out["layer_speedup_bound"] = 1 / (1 / 3 + (2 / 3) / r)   # a layer that is all GEMMs, wgrad in bf16
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("fp8_probe.py times fp8 GEMMs on a GPU: no CUDA device is available")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    if not hasattr(torch, "_scaled_grouped_mm") or not hasattr(F, "grouped_mm"):
        result["reason"] = f"torch {torch.__version__} has no torch._scaled_grouped_mm or F.grouped_mm"
    elif torch.cuda.get_device_capability() < (9, 0):
        result["reason"] = f"rowwise fp8 grouped GEMMs need compute capability 9.0+, this GPU has " \
                           f"{torch.cuda.get_device_capability()}"
    else:
        for name, shape in SHAPES.items():
            try:
                result["shapes"][name] = probe(*shape)
            except Exception as error:   # a torch build whose kernel refuses these sizes: say so, go on
                result["shapes"][name] = {"reason": f"{type(error).__name__}: {error}"[:300]}
            print(name, result["shapes"][name])
    if "reason" in result:
        print("fp8 probe not run:", result["reason"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
