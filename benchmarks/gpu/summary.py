"""The one table run.sh prints last: every target of issues 33 and 34 with what this run measured.

    python benchmarks/gpu/summary.py OUT_DIR

Reads what run.sh's steps left in OUT_DIR (launches_graphs.json, graphs_compiled.json, peers.json,
peers_compiled.json, fp8.json, fused_kernels.json, fsdp_*.log, summary.txt);
a step that did not run or failed gives its rows as "not measured" with the step's exit code.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

FLOOR_TARGET, TFLOPS_TARGET, AMP_TARGET, FSDP_TARGET, HOST_TARGET, FP8_TARGET = 1.10, 550.0, 1.25, 0.90, 0.80, 1.3
DROP_IN_TARGET = 1.03
FUSED_DIFFERENCE = 2e-2     # bf16: a few roundings of the largest magnitude
PEERS = ("hf_grouped_mm", "deepspeed", "tutel", "einsum_fairseq")


def load(out: Path, name: str):
    path = out / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_codes(out: Path) -> dict:
    """step -> exit code, from run.sh's summary.txt lines "<step> rc=<code>"."""
    try:
        return dict(re.findall(r"(\S+) rc=(\d+)", (out / "summary.txt").read_text()))
    except OSError:
        return {}


def verdict(value, target, lower_is_better=True):
    if value is None:
        return "open"
    return "met" if (value <= target if lower_is_better else value >= target) else "MISSED"


def graph_rows(graphs: list) -> list:
    table = []
    for g in graphs:
        if "error" in g:
            table.append(("33.4", f"CUDA graph, {g['case']}", "capture + replay = eager", g["error"], "MISSED"))
        else:
            table.append(("33.4", f"CUDA graph, {g['case']}", "replay = eager",
                          f"eager {g['eager_ms']:.3f} ms, graphed {g['graphed_ms']:.3f} ms ({g['ratio']:.2f}x); "
                          f"errors out {g['output_error']:.1e} grad {g['gradient_error']:.1e}, stats "
                          f"{'equal' if g['stats_match'] else 'DIFFER'}", "met" if g["replay_ok"] else "MISSED"))
    return table


def rows(out: Path) -> list:
    codes = step_codes(out)

    def missing(step):
        rc = codes.get(step)
        return f"not measured (step {step} {'did not run' if rc is None else f'rc={rc}'})"

    table = []
    lg = load(out, "launches_graphs.json")
    if lg is None:
        table.append(("33.1-4", "launches, host time, CUDA graphs", "", missing("launches_graphs"), "open"))
    else:
        by = {(r["case"], r["variant"]): r for r in lg.get("launches", [])}
        for case in ("dropless_bf16", "bias_fixed_bf16", "autocast_fp32"):
            r = by.get((case, "ours"), {})
            side = ", ".join(f"{v} {by[(case, v)].get('total', by[(case, v)].get('error'))}"
                             for v in ("hf_grouped_mm", "bare_grouped_gemms") if (case, v) in by)
            total = r.get("total")
            kernels = f" ({r['kernels']} kernels, the rest memsets/memcpys)" if "kernels" in r else ""
            table.append(("33.1", f"launches fwd+bwd (profiler), {case}", f"<= {r.get('budget')}",
                          f"{total if total is not None else r.get('error')}{kernels}; {side}",
                          verdict(total, r.get("budget") or 0)))
        h = lg.get("host")
        table.append(("33.3", "host time, tiny shape on the GPU, ours / HF block", f"<= {HOST_TARGET}",
                      f"{h['ratio']:.3f} ({h['median_ms']['ours']:.3f} vs {h['median_ms']['hf_grouped_mm']:.3f} ms)"
                      if h else missing("launches_graphs"), verdict(h["ratio"] if h else None, HOST_TARGET)))
        table += graph_rows(lg["graphs"]) if "graphs" in lg else [
            ("33.4", "CUDA graph replays = eager", "", missing("launches_graphs"), "open")]
    compiled = load(out, "graphs_compiled.json")
    table += graph_rows(compiled["graphs"]) if compiled else [
        ("33.4", "torch.compile(mode='reduce-overhead') = eager", "", missing("graphs_compiled"), "open")]
    for model, mode in (("mixtral_gpu", "eager"), ("fine_gpu", "eager"), ("mixtral_gpu_compiled", "compiled")):
        log = out / f"fsdp_{model}.log"
        text = log.read_text() if log.is_file() else ""
        match = re.search(r"swapped / HF = ([0-9.]+)", text)
        value = float(match.group(1)) if match else None
        shares = re.search(r"HF's own [0-9.]+ s \((\d+)% of its step\), swapped [0-9.]+ s \((\d+)%\)", text)
        where = f" (MoE blocks: {shares.group(1)}% / {shares.group(2)}% of the steps)" if shares else ""
        table.append(("33.5", f"FSDP2 step swapped / HF's own, {model.replace('_compiled', '')}, {mode}",
                      f"<= {FSDP_TARGET}", f"{value:.3f}{where}" if value is not None else missing(f"fsdp_{model}"),
                      verdict(value, FSDP_TARGET)))

    first = out / "first_runs.log"
    checks = re.findall(r"^(first run|DeepSpeed example): (.*): (ok|FAILED)$", first.read_text(), re.M) \
        if first.is_file() else []
    table.append(("42.1", "users' first runs: moe-plugin train on cuda, the DeepSpeed example (bf16)",
                  "both run, loss falls", "; ".join(f"{name}: {what}" for name, what, _ in checks)
                  or missing("first_runs"),
                  "open" if len(checks) < 2 else "met" if all(v == "ok" for *_, v in checks) else "MISSED"))
    peers = load(out, "peers.json")
    if peers is None:
        table.append(("34.1/4", "layer vs gated floor, TFLOP/s, peers", "", missing("peers"), "open"))
    else:
        for name, s in peers["shapes"].items():
            ms, ratio, tf = s["median_ms"], s["ratio_to_floor_gated"], s["tflops"]
            ours = min((c for c in ("moe_plugin", "moe_plugin_graphed", "moe_plugin_compiled") if c in ms),
                       key=ms.get, default=None)
            if ours is None or "floor_gated" not in ms:
                table.append(("34.1", f"{name}: layer vs gated floor", "", f"not measured: {s['reasons']}", "open"))
                continue
            if name in ("hf", "sonic"):
                table.append(("34.1", f"{name}: best of ours ({ours}) / floor_gated", f"<= {FLOOR_TARGET}",
                              f"{ratio[ours]:.3f} ({ms[ours]:.2f} vs {ms['floor_gated']:.2f} ms)",
                              verdict(ratio[ours], FLOOR_TARGET)))
                table.append(("34.1", f"{name}: TFLOP/s of {ours} (peak {peers['peak_tflops']:.0f})",
                              f">= {TFLOPS_TARGET:.0f}", f"{tf[ours]:.0f}",
                              verdict(tf[ours], TFLOPS_TARGET, lower_is_better=False)))
            if "moe_plugin_tutel" in ms and "moe_plugin" in ms:     # issue 43: the Tutel drop-in costs nothing
                r = ms["moe_plugin_tutel"] / ms["moe_plugin"]
                table.append(("43.6", f"{name}: Tutel drop-in / moe_plugin", f"<= {DROP_IN_TARGET}",
                              f"{r:.3f} ({ms['moe_plugin_tutel']:.2f} vs {ms['moe_plugin']:.2f} ms)",
                              verdict(r, DROP_IN_TARGET)))
            if "moe_plugin_fp32_amp" in ms:
                table.append(("34.1", f"{name}: fp32 params under autocast / floor_gated (floor has no casts)",
                              f"<= {AMP_TARGET}", f"{ratio['moe_plugin_fp32_amp']:.3f}",
                              verdict(ratio["moe_plugin_fp32_amp"], AMP_TARGET)))
            for peer in PEERS:
                if peer in ms:
                    r = ms[ours] / ms[peer]
                    table.append(("34.4", f"{name}: {ours} / {peer}", "< 1", f"{r:.3f} ({ms[ours]:.2f} vs "
                                  f"{ms[peer]:.2f} ms; {peer} {ms[peer] / ms[ours]:.2f}x ours)", verdict(r, 0.999)))
                else:
                    table.append(("34.4", f"{name}: {peer}", "< 1", s["reasons"].get(peer, "not run"), "n/a"))
    compiled_peers = load(out, "peers_compiled.json")
    for name, s in (compiled_peers or {}).get("shapes", {}).items():
        if "moe_plugin_compiled" in s["median_ms"] and "floor_gated" in s["median_ms"]:
            table.append(("34.1", f"{name}: moe_plugin_compiled / floor_gated; TFLOP/s", f"<= {FLOOR_TARGET}; "
                          f">= {TFLOPS_TARGET:.0f}", f"{s['ratio_to_floor_gated']['moe_plugin_compiled']:.3f}; "
                          f"{s['tflops']['moe_plugin_compiled']:.0f}",
                          verdict(s["ratio_to_floor_gated"]["moe_plugin_compiled"], FLOOR_TARGET)))
        else:
            table.append(("34.1", f"{name}: moe_plugin_compiled", "", str(s["reasons"])[:200], "open"))
    fp8 = load(out, "fp8.json")
    if fp8 is None:
        table.append(("34.5", "fp8 grouped GEMM probe", "", missing("fp8_probe"), "open"))
    elif "reason" in fp8:
        table.append(("34.5", "fp8 grouped GEMM probe", "", fp8["reason"], "open"))
    else:
        for name, p in fp8["shapes"].items():
            if "reason" in p:
                table.append(("34.5", f"{name}: fp8 probe", "", p["reason"], "open"))
                continue
            gemm_share = None
            if peers and name in peers["shapes"] and "moe_plugin" in peers["shapes"][name]["ratio_to_floor_gated"]:
                gemm_share = 1 / peers["shapes"][name]["ratio_to_floor_gated"]["moe_plugin"]
            layer = (1 / ((1 - gemm_share) + gemm_share / p["layer_speedup_bound"])) if gemm_share else None
            table.append(("34.5", f"{name}: fp8/bf16 GEMM speedup (quant. incl.); layer estimate",
                          f">= {FP8_TARGET} (layer)",
                          f"GEMMs {p['gemm_speedup']:.2f}x, all-GEMM bound {p['layer_speedup_bound']:.2f}x, "
                          f"this layer ~{layer:.2f}x" if layer else f"GEMMs {p['gemm_speedup']:.2f}x, bound "
                          f"{p['layer_speedup_bound']:.2f}x",
                          ("plausible" if (layer or p["layer_speedup_bound"]) >= FP8_TARGET else "not plausible")))
    table += fused_kernel_rows(load(out, "fused_kernels.json"), missing("fused_kernels"))
    return table


def fused_kernel_rows(fused, missing: str) -> list:
    """34.3: each fused grouped GEMM's time against what it replaces (the layer takes it where < 1) and its result
    against the unfused one's (bf16: within FUSED_DIFFERENCE of the largest magnitude)."""
    if fused is None:
        return [("34.3", "fused grouped GEMMs vs today's passes", "", missing, "open")]
    table = []
    for name, shape in fused["shapes"].items():
        for k in shape["kernels"]:
            measure = f"{name}: {k['kernel']} fused / unfused"
            if "error" in k:
                table.append(("34.3", measure, "< 1 (taken)", k["error"], "MISSED"))
                continue
            right = k["difference"] <= FUSED_DIFFERENCE
            table.append(("34.3", measure, "< 1 (taken)", f"{k['ratio']:.3f} ({k['fused_ms']:.3f} vs "
                          f"{k['unfused_ms']:.3f} ms); result differs by {k['difference']:.1e}",
                          ("taken" if k["ratio"] < 1 else "not taken") if right else "WRONG RESULT"))
    return table


def format_rows(table: list) -> str:
    widths = [max(len(str(r[i])) for r in table + [("issue", "measure", "target", "measured", "verdict")])
              for i in range(5)]
    widths[3] = min(widths[3], 90)
    head = ("issue", "measure", "target", "measured", "verdict")
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in table]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "gpu-results")
    print("== every target of issues 33 and 34, this run (" + str(out) + ")")
    print(format_rows(rows(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
