"""benchmarks/gpu/run.sh, the one-call GPU check, stays runnable: it parses, the test files it names
exist, and every benchmark flag it passes is one `moe-plugin bench` accepts."""
import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_plugin import bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "run.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_named_test_files_exist_and_hold_cuda_tests():
    text = SCRIPT.read_text()
    block = re.search(r"CUDA_TESTS=\((.*?)\)", text, re.S).group(1)
    files = block.split()
    assert files, "no test files named"
    for name in files:
        path = ROOT / name
        assert path.is_file(), name
        assert "cuda" in path.read_text(), f"{name} holds no CUDA test"


def test_benchmark_flags_are_accepted():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    known = {option for action in parser._actions for option in action.option_strings}
    text = SCRIPT.read_text().replace("\\\n", " ")
    bench_lines = [line for line in text.splitlines() if re.search(r"cli bench|BENCH", line) and "--" in line]
    flags = {flag for line in bench_lines for flag in re.findall(r"(--[a-z][a-z0-9-]*)", line)}
    assert {"--device", "--autocast", "--compile", "--hf"} <= flags
    assert flags - {"--no-deps", "--no-index", "--no-build-isolation", "--use-pep517"} <= known, flags - known


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_profile_script_says_it_needs_a_gpu():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "profile_layer.py"), "--top-k", "3"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "no CUDA device is available" in result.stderr, result.stderr


def test_fsdp_step_flags_exist():
    text = SCRIPT.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "bench_fsdp.py" in line and "step " in line)
    source = (ROOT / "benchmarks" / "bench_fsdp.py").read_text()
    for flag in re.findall(r"(--[a-z][a-z0-9-]*)", line):
        assert f'"{flag}"' in source, flag
    assert "mixtral_gpu" in source
