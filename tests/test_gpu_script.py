"""benchmarks/gpu/run.sh, the one-call GPU check of issues 33 and 34, stays runnable where no GPU is: it parses,
every file it names exists, every step has a time limit, the fast set fits 6 minutes, every flag it passes is
one the called script accepts, the peers script's CPU smoke run prints every peer's row or its reason, the
summary turns partial results into one table, and each GPU script says it needs a GPU."""
import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.paths import load_script
from moe_plugin.cli import bench

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"
SCRIPT = GPU / "run.sh"
FAST_SET_LIMIT_S = 360
OTHER_SET_LIMIT_S = 420    # --slow-only, --tests: each a later device call of at most 10 minutes
MODES = ("fast", "slow", "tests")


def script_lines():
    """run.sh's lines with the backslash continuations joined."""
    return SCRIPT.read_text().replace("\\\n", " ").splitlines()


def steps_by_mode():
    """[(kind, name, limit, line, modes)] of run.sh's step/background/await_background lines, where modes are the
    run modes (fast, slow, tests) whose `if wants ...; then` block holds the line (all outside any block)."""
    out, modes = [], set(MODES)
    for line in script_lines():
        text = line.strip()
        block = re.match(r"if wants ([a-z ]+); then", text)
        if block:
            modes = set(block.group(1).split()) - {"full"}
            assert modes <= set(MODES), text
        elif text == "fi":
            modes = set(MODES)
        match = re.match(r"(step|background) (\S+) (\S+) ", text)
        if match:
            out.append((match.group(1), match.group(2), match.group(3), text, set(modes)))
        elif text.startswith("await_background"):
            out.append(("await", text.split()[1], None, text, set(modes)))
    return out


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("name", ["run.sh", "setup_peers.sh", "make_carry.sh", "first_runs.sh"])
def test_scripts_parse(name):
    result = subprocess.run(["bash", "-n", str(GPU / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_named_test_files_exist_and_hold_cuda_tests():
    block = re.search(r"CUDA_TESTS=\((.*?)\)", SCRIPT.read_text(), re.S).group(1)
    files = block.split()
    assert files, "no test files named"
    for name in files:
        path = ROOT / name
        assert path.is_file(), name
        assert "cuda" in path.read_text(), f"{name} holds no CUDA test"


def test_every_file_named_exists():
    text = SCRIPT.read_text() + (GPU / "setup_peers.sh").read_text()
    named = set(re.findall(r"((?:benchmarks|tests)/[\w/.-]+\.(?:py|sh))", text))
    assert {"benchmarks/bench_peers.py", "benchmarks/gpu/launches_graphs.py", "benchmarks/gpu/fp8_probe.py",
            "benchmarks/gpu/setup_peers.sh", "benchmarks/gpu/summary.py", "benchmarks/bench_fsdp.py"} <= named
    for name in named:
        assert (ROOT / name).is_file(), name


def test_every_command_runs_as_a_step_with_a_limit():
    steps = steps_by_mode()
    assert len(steps) >= 10
    for kind, name, limit, line, _ in steps:
        if kind != "await":
            assert limit.isdigit() and int(limit) > 0, line
    names = [s[1] for s in steps if s[0] != "await"]
    assert len(names) == len(set(names)), names
    for line in script_lines():     # nothing that runs Python or pip escapes a step's timeout
        if re.search(r'"\$PY"|pytest|pip install', line) and "sys.exit" not in line:
            assert re.match(r"\s*(step|background) ", line), line


def test_fast_set_fits_six_minutes_with_the_background_step_inside():
    fast = [s for s in steps_by_mode() if "fast" in s[4]]
    foreground = [int(limit) for kind, _, limit, _, _ in fast if kind == "step"]
    assert sum(foreground) <= FAST_SET_LIMIT_S, (sum(foreground), foreground)
    for index, (kind, name, limit, _, _) in enumerate(fast):
        if kind == "background":    # it must end before the foreground reaches its wait, at the latest
            wait = next(i for i, s in enumerate(fast) if s[0] == "await" and s[1] == name)
            before = sum(int(s[2]) for s in fast[index + 1:wait] if s[0] == "step")
            assert int(limit) <= before, (name, limit, before)
    named = {s[1] for s in fast}
    assert {"launches_graphs", "fp8_probe", "fsdp_mixtral_gpu", "first_runs", "peers", "summary"} <= named
    for mode in ("slow", "tests"):
        steps = [s for s in steps_by_mode() if mode in s[4]]
        assert not [s for s in steps if s[0] == "background"], mode
        assert sum(int(s[2]) for s in steps if s[0] == "step") <= OTHER_SET_LIMIT_S, mode
    assert "cuda_tests" in {s[1] for s in steps_by_mode() if s[4] == {"tests"}}
    assert {"fsdp_fine_gpu", "graphs_compiled", "peers_compiled"} <= {s[1] for s in steps_by_mode() if s[4] == {"slow"}}


def _step_args(name):
    line = next(s[3] for s in steps_by_mode() if s[1] == name)
    words = line.replace('"$OUT/', "OUT/").replace('"', "").split()
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return words[script + 1:]


def test_each_scripts_flags_are_accepted():
    bench_peers = load_script("benchmarks/bench_peers.py")
    for name in ("peers", "peers_compiled"):
        args = bench_peers.parse_args(_step_args(name))
        assert args.device == "cuda" and set(args.shapes.split(",")) <= set(bench_peers.SHAPES)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--steps")
    parser.add_argument("--rows")
    parser.parse_args(_step_args("profile_hf_shape"))
    for name in ("launches_graphs", "fp8_probe"):
        assert _step_args(name)[0] == "--json"
    assert _step_args("graphs_compiled")[:2] == ["--compile", "--json"]


def test_fsdp_step_flags_exist():
    source = (ROOT / "benchmarks" / "bench_fsdp.py").read_text()
    for name in ("fsdp_mixtral_gpu", "fsdp_fine_gpu"):
        words = _step_args(name)
        for flag in (w for w in words if w.startswith("--")):
            assert f'"{flag}"' in source, flag
        assert words[words.index("--hf-model") + 1] in source


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    path = tmp_path_factory.mktemp("peers") / "peers.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--smoke", "--json",
                             str(path)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(path.read_text())


CANDIDATES = ("moe_plugin", "moe_plugin_graphed", "moe_plugin_compiled", "moe_plugin_fp32_amp", "floor_gated",
              "floor_relu", "hf_grouped_mm", "deepspeed", "tutel", "moe_plugin_tutel", "einsum_fairseq")


def test_peers_smoke_prints_each_peers_row_or_reason(smoke):
    stdout, result = smoke
    assert set(result["shapes"]) == {"tiny_relu", "tiny_swiglu"}
    for name, shape in result["shapes"].items():
        assert set(shape["median_ms"]) | set(shape["reasons"]) == set(CANDIDATES), name
        assert not set(shape["median_ms"]) & set(shape["reasons"])
        for timed in ("moe_plugin", "floor_gated", "floor_relu", "einsum_fairseq", "moe_plugin_tutel"):
            assert 0 < shape["median_ms"][timed] < 1e4, (name, timed)
        assert shape["ratio_to_floor_gated"]["floor_gated"] == 1.0
        assert sum(shape["routed_rows_per_expert"]) <= shape["config"]["tokens"] * shape["config"]["top_k"]
        for candidate in CANDIDATES:     # the table names every candidate of every shape
            assert re.search(rf"^{candidate} ", stdout, re.M), candidate
    assert "CUDA graphs need a GPU" in result["shapes"]["tiny_relu"]["reasons"]["moe_plugin_graphed"]
    assert "hf_grouped_mm" in result["shapes"]["tiny_swiglu"]["median_ms"]        # HF's block: SwiGLU, dropless
    assert "not this layer" in result["shapes"]["tiny_relu"]["reasons"]["hf_grouped_mm"]
    swiglu = result["shapes"]["tiny_swiglu"]
    assert "deepspeed" in swiglu["median_ms"] or "capacity" in swiglu["reasons"]["deepspeed"]   # no dropless mode


def test_summary_turns_partial_results_into_one_table(tmp_path, smoke):
    summary = load_script("benchmarks/gpu/summary.py")
    (tmp_path / "peers.json").write_text(json.dumps(smoke[1]))
    (tmp_path / "summary.txt").write_text("install rc=0\nlaunches_graphs rc=124\n")
    launches = [dict(case="dropless_bf16", variant="ours", budget=30, total=29),
                dict(case="dropless_bf16", variant="hf_grouped_mm", budget=None, total=61),
                dict(case="bias_fixed_bf16", variant="ours", budget=40, total=41)]
    table = summary.rows(tmp_path)
    assert any("launches_graphs rc=124" in row[3] for row in table)
    drop_in = [row for row in table if row[0] == "43.6"]      # the Tutel drop-in against our layer, per shape
    assert len(drop_in) == len(smoke[1]["shapes"]) and all(row[4] in ("met", "MISSED") for row in drop_in), drop_in
    assert any(row[1].startswith("FSDP2") and "did not run" in row[3] for row in table)
    (tmp_path / "launches_graphs.json").write_text(json.dumps(dict(
        launches=launches, host=dict(ratio=0.7, median_ms=dict(ours=0.7, hf_grouped_mm=1.0)),
        graphs=[dict(case="tiny", error="RuntimeError: capture failed")])))
    table = {row[1]: row for row in summary.rows(tmp_path)}
    assert table["launches fwd+bwd (profiler), dropless_bf16"][4] == "met"
    assert "hf_grouped_mm 61" in table["launches fwd+bwd (profiler), dropless_bf16"][3]
    assert table["launches fwd+bwd (profiler), bias_fixed_bf16"][4] == "MISSED"
    assert table["CUDA graph, tiny"][4] == "MISSED"
    assert table["host time, tiny shape on the GPU, ours / HF block"][4] == "met"
    (tmp_path / "fsdp_mixtral_gpu.log").write_text(   # bench_fsdp.py's two lines, as it prints them
        "MixtralForCausalLM (mixtral_gpu, 4x1024 tokens per rank) under FSDP2 ...: HF's own 0.047 s, swapped 0.046 s "
        "(medians), swapped / HF = 0.987 (median of the rounds' ratios); first losses 10.4 / 10.4\n"
        "of which in the MoE blocks (forward and backward): HF's own 0.012 s (26% of its step), swapped 0.011 s (24%); "
        "the rest of the step: HF's own 0.035 s, swapped 0.035 s\n")
    row = {row[1]: row for row in summary.rows(tmp_path)}["FSDP2 step swapped / HF's own, mixtral_gpu, eager"]
    assert row[3] == "0.987 (MoE blocks: 26% / 24% of the steps)" and row[4] == "MISSED"
    printed = summary.format_rows(list(table.values()))
    assert printed.count("\n") == len(table)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
@pytest.mark.parametrize("script", ["profile_layer.py", "launches_graphs.py", "fp8_probe.py"])
def test_gpu_scripts_say_they_need_a_gpu(script):
    result = subprocess.run([sys.executable, str(GPU / script)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "no CUDA device is available" in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("bash") is None,
                    reason="checks what run.sh does without a GPU")
def test_run_script_stops_without_a_gpu(tmp_path):
    import tarfile
    env = {**__import__("os").environ, "RESULTS": str(tmp_path / "results"), "OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "no CUDA device" in (tmp_path / "results" / "no_gpu.txt").read_text()
    assert not (tmp_path / "results" / "peers_setup.log").exists()
    with tarfile.open(tmp_path / "out" / "gpu-results.tgz") as packed:    # what the device tool brings back
        assert "./no_gpu.txt" in packed.getnames()


def test_fp8_probe_rowwise_scaling_round_trips():
    """The probe's quantization (its timed work besides the GEMM): each row's largest magnitude maps to e4m3's
    448, and scale x e4m3 gives the row back within e4m3's rounding."""
    fp8_probe = load_script("benchmarks/gpu/fp8_probe.py")
    x_RK = torch.randn(37, 48) * torch.rand(37, 1) * 100
    q_RK, scale_R = fp8_probe.rowwise(x_RK, 1)
    assert q_RK.dtype == torch.float8_e4m3fn and scale_R.shape == (37,)
    assert torch.equal(q_RK.float().abs().amax(1), torch.full((37,), 448.0))
    back_RK = q_RK.float() * scale_R[:, None]
    assert float((back_RK - x_RK).norm() / x_RK.norm()) < 0.05
    w_ENK = torch.randn(3, 16, 32)
    q_ENK, scale_EN = fp8_probe.rowwise(w_ENK, 2)
    assert scale_EN.shape == (3, 16)
    assert float((q_ENK.float() * scale_EN[..., None] - w_ENK).norm() / w_ENK.norm()) < 0.05


def test_summary_judges_floor_throughput_peers_and_fp8(tmp_path):
    """The verdicts the GPU run will print, on made-up results: the layer at 1.05x the gated floor meets 1.10 and
    its 500 TFLOP/s miss 550; a peer slower than ours is beaten; fp8 GEMMs 1.6x faster bound an all-GEMM layer at
    1/(1/3 + (2/3)/1.6) = 1.33x, which a layer at its floor reaches, but one at 1.5x its floor (2/3 GEMMs) gains
    1/(1/3 + (2/3)/1.33) = 1.2x."""
    summary = load_script("benchmarks/gpu/summary.py")
    ms = {"moe_plugin": 10.5, "moe_plugin_graphed": 10.0, "floor_gated": 9.5, "hf_grouped_mm": 20.0}
    shape = {"median_ms": ms, "reasons": {"tutel": "skipped (tutel: ModuleNotFoundError)"},
             "ratio_to_floor_gated": {n: t / 9.5 for n, t in ms.items()},
             "tflops": {n: 5000 / t for n, t in ms.items()}}
    (tmp_path / "peers.json").write_text(json.dumps({"peak_tflops": 790.0, "shapes": {"hf": shape}}))
    (tmp_path / "fp8.json").write_text(json.dumps({"shapes": {"hf": {"gemm_speedup": 1.6,
                                                                   "layer_speedup_bound": 1 / (1 / 3 + 2 / 3 / 1.6)}}}))
    table = {row[1]: row for row in summary.rows(tmp_path)}
    floor = table["hf: best of ours (moe_plugin_graphed) / floor_gated"]
    assert floor[3].startswith("1.053") and floor[4] == "met"
    assert table["hf: TFLOP/s of moe_plugin_graphed (peak 790)"][3:] == ("500", "MISSED")
    assert table["hf: moe_plugin_graphed / hf_grouped_mm"][4] == "met"
    assert "ModuleNotFoundError" in table["hf: tutel"][3]
    fp8 = table["hf: fp8/bf16 GEMM speedup (quant. incl.); layer estimate"]   # eager at 10.5/9.5 x its floor:
    assert "bound 1.33x" in fp8[3] and "this layer ~1.29x" in fp8[3] and fp8[4] == "not plausible"   # 90% GEMMs
    for ratio, layer, verdict in ((1.0, "1.33", "plausible"), (1.5, "1.20", "not plausible")):
        shape["ratio_to_floor_gated"]["moe_plugin"] = ratio
        (tmp_path / "peers.json").write_text(json.dumps({"peak_tflops": 790.0, "shapes": {"hf": shape}}))
        rows = {row[1]: row for row in summary.rows(tmp_path)}
        fp8 = rows["hf: fp8/bf16 GEMM speedup (quant. incl.); layer estimate"]
        assert f"this layer ~{layer}x" in fp8[3] and fp8[4] == verdict


def test_summary_judges_the_users_first_runs(tmp_path):
    """first_runs.sh's check lines become one row: met when both held, MISSED when one failed, open when one is
    missing (the step stopped before it)."""
    summary = load_script("benchmarks/gpu/summary.py")
    row = "users' first runs: moe-plugin train on cuda, the DeepSpeed example (bf16)"
    log = tmp_path / "first_runs.log"
    trained = "first run: train loss 5.1 -> 2.2, plots [2]: ok"
    stalled = "first run: train loss 5.1 -> 5.0, plots [2]: FAILED"
    for lines, verdict in (([trained, "DeepSpeed example: loss 4 -> 2.4: ok"], "met"),
                           ([stalled, "DeepSpeed example: loss 4 -> 2: ok"], "MISSED"), ([trained], "open")):
        log.write_text("noise\n" + "\n".join(lines) + "\n")
        got = {r[1]: r for r in summary.rows(tmp_path)}[row]
        assert got[4] == verdict and "first run: train loss 5.1" in got[3], lines
