import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.cli.bench import _deepspeed_step
from moe_plugin.cli import main

TINY = ["bench", "--model-dim", "16", "--hidden-size", "32", "--num-experts", "4", "--tokens", "57",
        "--rounds", "2", "--warmup", "0", "--json"]


def test_bench_json_times_every_candidate_and_checks_the_einsum_reference():
    out = subprocess.run([sys.executable, "-m", "moe_plugin.cli"] + TINY, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    expected = {"moe_plugin", "bare_gemm", "einsum", "floor_gated", "floor_relu"}
    if importlib.util.find_spec("deepspeed"):
        expected.add("deepspeed")
    assert set(result["median_ms"]) == expected
    assert all(ms > 0 for ms in result["median_ms"].values())
    assert result["ratio_to_bare_gemm"]["bare_gemm"] == 1.0
    assert result["notes"]["max_abs_diff_vs_einsum"] < 1e-5
    assert result["config"]["num_experts"] == 4 and result["tokens"] == 57


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_bench_times_hf_block_in_a_fresh_process():
    """--hf times HF's Mixtral block even where fairseq's unloadable torchaudio is installed (it was skipped there)."""
    args = TINY + ["--hf", "--activation", "swiglu", "--no-bias", "--capacity-factor", "0", "--skip", "einsum,deepspeed"]
    out = subprocess.run([sys.executable, "-m", "moe_plugin.cli"] + args, capture_output=True, text=True, check=True,
                         timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["median_ms"]["hf_grouped_mm"] > 0, result["notes"]


@pytest.mark.parametrize("activation, capacity", [("swiglu", "1.0"), ("relu", "0")])
def test_bench_floors_count_the_layers_rows_and_flops(capsys, activation, capacity):
    """floor_gated runs the layer's own matrices on the rows the layer kept per expert; TFLOP/s follow
    18*T*K*H*D (gated) / 12*T*K*H*D (otherwise; the ReLU floors always 12)."""
    T, D, H, K = 203, 32, 48, 3
    args = ["bench", "--model-dim", str(D), "--hidden-size", str(H), "--num-experts", "5", "--top-k", str(K),
            "--tokens", str(T), "--activation", activation, "--capacity-factor", capacity, "--rounds", "1",
            "--warmup", "0", "--skip", "einsum,deepspeed", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stats = result["moe_plugin_stats"]
    rows = result["routed_rows_per_expert"]
    assert rows == [min(load, stats["capacity"]) for load in stats["tokens_per_expert"]]
    assert sum(rows) == round(T * K * (1 - stats["dropped_fraction"]))
    if capacity != "0":
        assert sum(rows) < T * K      # dropped choices are not in the floor
    gated_per_row = 18 if activation == "swiglu" else 12
    for name, ms in result["median_ms"].items():
        per_row = 12 if name in ("floor_relu", "bare_gemm") else gated_per_row
        assert result["tflops"][name] == pytest.approx(per_row * T * K * H * D / (ms * 1e-3) / 1e12, rel=1e-9)
    assert result["ratio_to_floor_gated"]["floor_gated"] == 1.0
    assert result["peak_tflops"] > 0


def test_bench_under_autocast_with_compile(capsys):
    assert main(TINY + ["--autocast", "bf16", "--compile", "--skip", "deepspeed"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["median_ms"]) == {"moe_plugin", "compiled", "bare_gemm", "einsum", "floor_gated", "floor_relu"}
    assert result["autocast"] == "bf16" and all(ms > 0 for ms in result["median_ms"].values())
    assert result["notes"]["max_abs_diff_vs_einsum"] < 5e-2      # bf16 outputs of the same routes


def test_bench_table(capsys):
    assert main(TINY[:-1] + ["--skip", "einsum,deepspeed"]) == 0
    table = capsys.readouterr().out
    assert "moe_plugin" in table and "bare_gemm" in table and "x bare_gemm" in table


def test_info(capsys):
    """Every optional dependency of the extras is listed, with its distribution and version when installed."""
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out
    for name in ("deepspeed", "fairseq", "omegaconf", "triton", "transformers", "accelerate", "sklearn"):
        line = next(line for line in out.splitlines() if line.startswith(f"{name}: "))
        if importlib.util.find_spec(name) is None:
            assert line.endswith("not installed")
        else:
            dist = {"sklearn": "scikit-learn", "fairseq": "fairseq-fixed"}.get(name, name)
            assert f"{dist} {importlib.metadata.version(dist)}" in line, line


def test_bench_help_shows_defaults_and_cost(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--tokens", 4096), ("--model-dim", 1024), ("--hidden-size", 4096), ("--num-experts", 8),
                          ("--top-k", 2), ("--capacity-factor", 1.25), ("--rounds", 3), ("--activation", "relu")):
        assert re.search(rf"{flag} \S+ [^()]*\(default: {default}\)", text), flag
    assert "minutes on a 2-core CPU" in text


@pytest.fixture
def process_group_closed_after():
    """The DeepSpeed baseline starts a one-process group in this process; later tests in it expect none."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed_baseline_runs_forward_and_backward(process_group_closed_after):
    config = MoEConfig(model_dim=16, hidden_size=32, num_experts=4, top_k=2, capacity_factor=1.25)
    x_TD = torch.randn(21, 16)
    step = _deepspeed_step(config, x_TD, torch.randn_like(x_TD), torch.float32)
    assert callable(step) and step() > 0


def test_core_imports_only_torch():
    code = ("import sys, moe_plugin, moe_plugin.cli.bench, moe_plugin.reference; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'omegaconf', 'deepspeed', 'fairseq', 'yaml'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_layer_is_a_drop_in_ffn():
    block = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    moe = MoELayer(model_dim=16, hidden_size=32, num_experts=4, top_k=2)
    x = torch.randn(3, 7, 16)
    y = x + moe(block.norm2(x))
    (y.sum() + moe.aux_loss).backward()
    assert y.shape == x.shape and moe.experts.w1_EDH.grad is not None
