"""benchmarks/gpu/fused_kernels.py, run.sh's timing of the fused grouped GEMMs against today's passes: its step's
flags parse, it says it needs a GPU, its CPU smoke run (the Triton interpreter) times every kernel and finds the
fused results equal to the unfused ones, and the summary turns its results (or their absence) into rows."""
import json
import re
import subprocess
import sys

import pytest
import torch

from helpers.paths import REPO as ROOT, load_script

GPU = ROOT / "benchmarks" / "gpu"


def load(name):
    return load_script(f"benchmarks/gpu/{name}.py")


def test_run_script_step_flags_parse():
    line = next(line for line in (GPU / "run.sh").read_text().splitlines() if "fused_kernels.py" in line
                and line.strip().startswith("step "))
    words = line.replace('"', "").split()
    assert words[1] == "fused_kernels" and int(words[2]) > 0
    args = load("fused_kernels").parse_args(words[words.index("benchmarks/gpu/fused_kernels.py") + 1:])
    assert args.shapes == "default,hf,sonic" and args.json.endswith("fused_kernels.json") and not args.smoke


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_says_it_needs_a_gpu():
    result = subprocess.run([sys.executable, str(GPU / "fused_kernels.py")], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 2 and "no CUDA device is available" in result.stderr, result.stderr


def test_smoke_run_and_summary_rows(tmp_path):
    pytest.importorskip("triton", reason="the smoke run needs triton (its interpreter)")
    path = tmp_path / "fused_kernels.json"
    result = subprocess.run([sys.executable, str(GPU / "fused_kernels.py"), "--smoke", "--json", str(path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    fused = json.loads(path.read_text())
    kernels = {k["kernel"]: k for k in fused["shapes"]["tiny"]["kernels"]}
    assert set(kernels) == {"gather_up", "dgrad_swiglu", "wgrad_gather"}, kernels
    for name, k in kernels.items():
        assert k["fused_ms"] > 0 and k["unfused_ms"] > 0 and k["ratio"] == k["fused_ms"] / k["unfused_ms"], name
        assert 0 < k["difference"] < 2e-2, (name, k["difference"])     # bf16 roundings, not 0: they differ
        assert re.search(rf"^tiny +{name} +fused", result.stdout, re.M), name
    summary = load("summary")
    rows = {row[1]: row for row in summary.fused_kernel_rows(fused, "not measured")}
    assert {row[4] for row in rows.values()} <= {"taken", "not taken"} and len(rows) == 3
    kernels["wgrad_gather"].update(ratio=0.5, difference=0.3)
    kernels["gather_up"].update(ratio=0.5, difference=1e-3)
    kernels["dgrad_swiglu"].clear()
    kernels["dgrad_swiglu"].update(kernel="dgrad_swiglu", error="CompilationError: out of resources")
    rows = {row[1]: row for row in summary.fused_kernel_rows(fused, "not measured")}
    assert rows["tiny: wgrad_gather fused / unfused"][4] == "WRONG RESULT"
    assert rows["tiny: gather_up fused / unfused"][4] == "taken"
    assert rows["tiny: dgrad_swiglu fused / unfused"][3:] == ("CompilationError: out of resources", "MISSED")
    path.unlink()       # a run stopped before the first shape's results
    (tmp_path / "summary.txt").write_text("fused_kernels rc=124\n")
    table = [row for row in summary.rows(tmp_path) if row[0] == "34.3"]
    assert table == [("34.3", "fused grouped GEMMs vs today's passes", "", "not measured (step fused_kernels rc=124)",
                      "open")]
