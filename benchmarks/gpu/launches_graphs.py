"""Issue 33 on the GPU, one process: launches, host time and CUDA graphs.

    python benchmarks/gpu/launches_graphs.py [--json FILE]

1. Launches of one forward + backward, counted by torch.profiler (every kernel, memset and memcpy the GPU ran),
   for the three configurations of `pytest -k launch_budget` (the CASES of benchmarks/count_launches.py, budgets
   30/40/45), with HF's Mixtral block on grouped_mm and the bare grouped GEMMs beside them.
2. Host time: a synchronized forward+backward at a tiny shape (T 32, D 64, H 64, E 8, top-2, SwiGLU, bf16),
   where the GPU work costs nothing, ours against HF's block, interleaved (target <= 0.80x); where that time goes:
   the host cost of one call of an aten op, a Triton kernel and a grouped GEMM, and a cProfile of ours' step.
3. CUDA graphs: the eager step against the same step captured as one graph and replayed, at the default shape
   (fp32 parameters under bf16 autocast, ReLU with biases, capacity 1.25), the default dims dropless SwiGLU in
   bf16, and the tiny shape; each replay's outputs and gradients compared with an eager step on the same input,
   and the layer's stats read after a replay compared with eager's. With --compile instead (slow: it compiles):
   torch.compile(layer, mode="reduce-overhead"), the documented way, against eager in the same way.

Legend: T tokens, D model dim, H hidden, E experts, K top-k.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_plugin.integrations.transformers  # noqa: E402,F401  (hides an unloadable torchaudio first)
from moe_plugin import MoEConfig, MoELayer  # noqa: E402
from graph_step import GraphedStep, check_replay, eager_reference, relative_error  # noqa: E402

# configuration -> (MoEConfig overrides, parameter dtype, autocast dtype or None, budget): count_launches.py's CASES
CASES = {
    "dropless_bf16": (dict(capacity_factor=0.0, bias=False), torch.bfloat16, None, 30),
    "bias_fixed_bf16": (dict(capacity_factor=1.25, bias=True), torch.bfloat16, None, 40),
    "autocast_fp32": (dict(capacity_factor=0.0, bias=False), torch.float32, torch.bfloat16, 45),
}
LAUNCH_SHAPE = dict(tokens=4096, model_dim=1024, hidden_size=1024, num_experts=8, top_k=2)
TINY = dict(tokens=32, model_dim=64, hidden_size=64, num_experts=8, top_k=2)
REPLAY_TOLERANCE = 1e-2


def autocast(dtype):
    return torch.autocast("cuda", dtype=dtype, cache_enabled=False) if dtype else contextlib.nullcontext()


def ours(shape, overrides, dtype, amp=None, activation="swiglu"):
    config = MoEConfig(model_dim=shape["model_dim"], hidden_size=shape["hidden_size"],
                       num_experts=shape["num_experts"], top_k=shape["top_k"], activation=activation, **overrides)
    layer = MoELayer(config).to(device="cuda", dtype=dtype)

    def forward(x):
        with autocast(amp):
            return layer(x), layer.aux_loss
    x = torch.randn(shape["tokens"], shape["model_dim"], device="cuda", dtype=dtype)
    return layer, forward, x


def hf(shape, dtype, amp=None):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = transformers.MixtralConfig(hidden_size=shape["model_dim"], intermediate_size=shape["hidden_size"],
                                        num_local_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"])
    config._experts_implementation = "grouped_mm"
    block = MixtralSparseMoeBlock(config).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)

    def forward(x):
        with autocast(amp):
            out = block(x.unsqueeze(0))
        return ((out[0] if isinstance(out, tuple) else out).squeeze(0),)
    return block, forward, torch.randn(shape["tokens"], shape["model_dim"], device="cuda", dtype=dtype)


def bare(shape, dtype):
    """Two grouped GEMMs with SwiGLU between, on T*K rows already grouped by expert (balanced)."""
    E, D, H, R = shape["num_experts"], shape["model_dim"], shape["hidden_size"], shape["tokens"] * shape["top_k"]
    module = torch.nn.Module()
    module.w1 = torch.nn.Parameter(torch.randn(E, D, 2 * H, device="cuda", dtype=dtype) / D ** 0.5)
    module.w2 = torch.nn.Parameter(torch.randn(E, H, D, device="cuda", dtype=dtype) / H ** 0.5)
    offs = (torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (R // E)).clamp_(max=R)
    offs[-1] = R

    def forward(x):
        gate, up = F.grouped_mm(x, module.w1, offs=offs).chunk(2, dim=-1)
        return (F.grouped_mm(F.silu(gate) * up, module.w2, offs=offs),)
    return module, forward, torch.randn(R, D, device="cuda", dtype=dtype)


def profiled_launches(params, forward, x) -> dict:
    """Device operations (kernels, memsets, memcpys) of one forward and one backward, by torch.profiler, with
    the gradients of x and params (the leaves) unset, as in training after zero_grad."""
    x = x.detach().requires_grad_()
    outputs = forward(x)
    grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(list(outputs), grads)      # a warm-up step: lazy state and compiles stay out
    torch.cuda.synchronize()
    for leaf in [x, *params]:     # as after optimizer.zero_grad(): the counted backward accumulates nothing (the
        leaf.grad = None          # 2026-11-28 count had one add per leaf in it, which count_launches.py leaves out)
    counts = {}
    for phase in ("forward", "backward"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
            if phase == "forward":
                outputs = forward(x)
            else:
                torch.autograd.backward(list(outputs), grads)
            torch.cuda.synchronize()
        device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts[phase] = len(device_events)
        counts[f"{phase}_memcpy"] = sum("memcpy" in e.name.lower() for e in device_events)
        counts[f"{phase}_memset"] = sum("memset" in e.name.lower() for e in device_events)
        counts[f"{phase}_names"] = dict(sorted(collections.Counter(e.name[:80] for e in device_events).items()))
    counts["total"] = counts["forward"] + counts["backward"]
    counts["kernels"] = counts["total"] - sum(counts[f"{p}_{kind}"] for p in ("forward", "backward")
                                              for kind in ("memcpy", "memset"))
    return counts


def launches() -> list:
    rows = []
    for case, (overrides, dtype, amp, budget) in CASES.items():
        torch.manual_seed(0)
        variants = {"ours": lambda: ours(LAUNCH_SHAPE, overrides, dtype, amp),
                    "hf_grouped_mm": lambda: hf(LAUNCH_SHAPE, dtype, amp),
                    "bare_grouped_gemms": lambda: bare(LAUNCH_SHAPE, amp or dtype)}
        if overrides["bias"]:        # HF's Mixtral has no expert biases: not the same layer
            del variants["hf_grouped_mm"]
        for variant, build in variants.items():
            try:
                module, forward, x = build()
                row = profiled_launches(list(module.parameters()), forward, x)
            except Exception as error:
                row = {"error": f"{type(error).__name__}: {error}"[:300]}
            rows.append(dict(case=case, variant=variant, budget=budget if variant == "ours" else None, **row))
    return rows


def step_timer(forward, params, x, grads):
    params = [p for p in params if p.requires_grad]
    x = x.detach().requires_grad_()

    def step():
        for p in params + [x]:
            p.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.autograd.backward(list(forward(x)), grads)
        torch.cuda.synchronize()
        return time.perf_counter() - start
    return step


def interleaved_ms(steps: dict, warmup: int, rounds: int, per_round: int = 1) -> dict:
    times = {name: [] for name in steps}
    for r in range(warmup + rounds):
        for name, step in steps.items():
            seconds = min(step() for _ in range(per_round))
            if r >= warmup:
                times[name].append(seconds)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def host_time() -> dict:
    torch.manual_seed(0)
    layer, forward, x = ours(TINY, dict(capacity_factor=0.0, bias=False), torch.bfloat16)
    block, hf_forward, _ = hf(TINY, torch.bfloat16)
    grad = torch.randn_like(x)
    ours_step = step_timer(forward, layer.parameters(), x, [grad, torch.ones((), device="cuda")])
    ms = interleaved_ms({"ours": ours_step, "hf_grouped_mm": step_timer(hf_forward, block.parameters(), x, [grad])},
                        warmup=20, rounds=200)
    return {"shape": TINY, "median_ms": ms, "ratio": ms["ours"] / ms["hf_grouped_mm"], "target": 0.80,
            "launch_us": launch_costs(), "profile": host_profile(ours_step)}


def launch_costs(calls: int = 2000) -> dict:
    """Host microseconds per call, where the device work is nothing (tiny tensors, one sync after all calls): an
    aten elementwise op, one of our Triton kernels (gather_sum, called as the layer calls it), a grouped GEMM."""
    from moe_plugin.ops import triton_kernels
    x_TD = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    pos_TK = torch.randperm(64, device="cuda").view(32, 2)
    w_EDO = torch.randn(8, 64, 64, device="cuda", dtype=torch.bfloat16)
    offs_E = torch.arange(8, 65, 8, device="cuda", dtype=torch.int32)
    rows_RD = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    calls_of = {"aten_add": lambda: x_TD.add(1.0),
                "triton_gather_sum": lambda: triton_kernels.gather_sum(rows_RD, pos_TK, None, None),
                "grouped_mm": lambda: torch._grouped_mm(rows_RD, w_EDO, offs=offs_E)}
    costs = {}
    for name, call in calls_of.items():
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        costs[name] = 1e6 * (time.perf_counter() - start) / calls
    return costs


def host_profile(step, steps: int = 100, lines: int = 30) -> list:
    """cProfile of steps synchronized steps of ours at the tiny shape: the functions of most own time (where the
    host time goes), as "tottime_ms/steps cumtime_ms/steps calls/steps function"."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:lines]
    return [f"{1e3 * tottime / steps:8.4f} {1e3 * cumtime / steps:8.4f} {calls / steps:6.1f} "
            f"{Path(file).name}:{line}({function})" for (file, line, function), (_, calls, tottime, cumtime, _) in top]


GRAPH_CASES = {    # name -> (shape, MoEConfig overrides, activation, parameter dtype, autocast dtype)
    "default_fp32_autocast": (dict(tokens=4096, model_dim=1024, hidden_size=4096, num_experts=8, top_k=2),
                              dict(capacity_factor=1.25, bias=True), "relu", torch.float32, torch.bfloat16),
    "default_dims_dropless_swiglu_bf16": (dict(tokens=4096, model_dim=1024, hidden_size=4096, num_experts=8, top_k=2),
                                          dict(capacity_factor=0.0, bias=False), "swiglu", torch.bfloat16, None),
    "tiny_dropless_swiglu_bf16": (TINY, dict(capacity_factor=0.0, bias=False), "swiglu", torch.bfloat16, None),
}


def graphs() -> list:
    rows = []
    for name, (shape, overrides, activation, dtype, amp) in GRAPH_CASES.items():
        torch.manual_seed(0)
        try:
            layer, forward, x = ours(shape, overrides, dtype, amp, activation)
            grads = [torch.randn(shape["tokens"], shape["model_dim"], device="cuda", dtype=amp or dtype),
                     torch.ones((), device="cuda")]
            graphed = GraphedStep(forward, layer.parameters(), x, grads)
            errors = check_replay(graphed, forward, layer.parameters(), grads)
            graphed.graph.replay()
            torch.cuda.synchronize()
            replay_stats = layer.stats["tokens_per_expert"]
            step_timer(forward, layer.parameters(), graphed.x_TD, grads)()
            graphed.restore()
            stats_match = replay_stats == layer.stats["tokens_per_expert"]
            ms = interleaved_ms({"eager": step_timer(forward, layer.parameters(), x, grads), "graphed": graphed.step},
                                warmup=3, rounds=20)
            graphed.restore()
            rows.append(dict(case=name, eager_ms=ms["eager"], graphed_ms=ms["graphed"],
                             ratio=ms["graphed"] / ms["eager"], output_error=errors["outputs"],
                             gradient_error=errors["gradients"], stats_match=stats_match,
                             replay_ok=stats_match and max(errors.values()) <= REPLAY_TOLERANCE))
        except Exception as error:   # a capture that fails is the finding: its row says why
            rows.append(dict(case=name, error=f"{type(error).__name__}: {error}"[:300]))
        torch.cuda.empty_cache()
    return rows


def compiled_graphs() -> list:
    """torch.compile(layer, mode="reduce-overhead") (the documented way to graph the layer; CUDA graphs by
    cudagraph trees, backward included): its step against eager on the same input, outputs and gradients."""
    rows = []
    for name in ("tiny_dropless_swiglu_bf16", "default_fp32_autocast"):
        shape, overrides, activation, dtype, amp = GRAPH_CASES[name]
        torch.manual_seed(0)
        try:
            layer, forward, x = ours(shape, overrides, dtype, amp, activation)
            compiled_layer = torch.compile(layer, mode="reduce-overhead")
            grads = [torch.randn(shape["tokens"], shape["model_dim"], device="cuda", dtype=amp or dtype),
                     torch.ones((), device="cuda")]
            params = [p for p in layer.parameters() if p.requires_grad]
            x_c = x.detach().clone().requires_grad_()

            def compiled_step():
                torch.compiler.cudagraph_mark_step_begin()
                for p in params + [x_c]:
                    p.grad = None
                with autocast(amp):
                    outputs = [compiled_layer(x_c), layer.aux_loss]
                torch.autograd.backward(outputs, grads)
                return outputs

            def timed_compiled_step():
                torch.cuda.synchronize()
                start = time.perf_counter()
                compiled_step()
                torch.cuda.synchronize()
                return time.perf_counter() - start

            for _ in range(4):       # compile, then cudagraph trees record and replay
                compiled_step()
            outputs = [o.detach().clone() for o in compiled_step()]
            gradients = [t.grad.detach().clone() for t in params + [x_c]]
            eager = eager_reference(forward, params, x_c, grads)
            errors = {"outputs": max(relative_error(a, b) for a, b in zip(outputs, eager["outputs"])),
                      "gradients": max(relative_error(a, b) for a, b in zip(gradients, eager["gradients"]))}
            ms = interleaved_ms({"eager": step_timer(forward, params, x, grads), "compiled": timed_compiled_step},
                                warmup=3, rounds=20)
            rows.append(dict(case=f"reduce-overhead {name}", eager_ms=ms["eager"], graphed_ms=ms["compiled"],
                             ratio=ms["compiled"] / ms["eager"], output_error=errors["outputs"],
                             gradient_error=errors["gradients"], stats_match=True,
                             replay_ok=max(errors.values()) <= REPLAY_TOLERANCE))
        except Exception as error:
            rows.append(dict(case=f"reduce-overhead {name}", error=f"{type(error).__name__}: {error}"[:300]))
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--compile", action="store_true",
                        help="only torch.compile(mode='reduce-overhead') against eager (slow: compiles)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("launches_graphs.py measures on a GPU: no CUDA device is available")
    if args.compile:
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "graphs": compiled_graphs()}
        for row in result["graphs"]:
            print("compiled graphs", row)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save():   # after each part: a run stopped at its time limit keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    result["launches"] = launches()
    for row in result["launches"]:
        print("launches", {k: v for k, v in row.items() if not k.endswith("_names")})
    save()
    result["host"] = host_time()
    print("host", {k: v for k, v in result["host"].items() if k != "profile"})
    print("host profile (ms per step: own, cumulative; calls per step)", *result["host"]["profile"], sep="\n  ")
    save()
    result["graphs"] = graphs()
    for row in result["graphs"]:
        print("graphs", row)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
