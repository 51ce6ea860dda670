"""`moe-plugin train --nproc-per-node N [--numa-binding MODE]`: the torchrun command it starts, the errors
before it starts one (numactl missing, no GPU, no launcher to pass the mode to), and one real launch.

What this module tests (moved here from the README):

Tested (tests/train/test_numa_binding.py): the exact torchrun command for every mode, torchrun's exit status returned,
each error above with nothing launched, and one real launch of `moe-plugin train --nproc-per-node 2` (two gloo
processes train and write result.json with world_size 2; ~16 s). Not tested here: an actual binding. This
machine has one NUMA node with 2 CPUs, no GPU and no numactl (the Debian package 2.0.16-1 installs from the
registry; `numactl --hardware` then shows 1 node), and torchrun's binding needs CUDA, so binding runs only
on a GPU node.
"""
import json
import subprocess
import sys

import pytest
import torch

from moe_plugin.cli import main
from moe_plugin.train import command, processes

TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.hidden_size=48", "moe.num_experts=4", "train.batch_size=4", "train.eval_batches=2",
        "train.warmup_steps=2", "log.progress=false", "log.plots=false"]
TORCHRUN = [sys.executable, "-m", "moe_plugin.train.torchrun", "--standalone", "--signals-to-handle",
            "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]


@pytest.fixture
def numa_ready(monkeypatch):
    """As on a GPU node with numactl installed."""
    monkeypatch.setattr(processes.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture
def launched(monkeypatch):
    """subprocess.call replaced: records the commands, exits 0."""
    commands = []
    monkeypatch.setattr(command.subprocess, "call", lambda argv: commands.append(argv) or 0)
    return commands


def test_torch_has_the_modes_the_help_names():
    assert set(processes.numa_modes()) == {"node", "socket", "exclusive", "core-complex"}


def test_command_without_binding(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert processes.torchrun_command(3, None, ["a.yaml", "train.steps=2"]) == \
        TORCHRUN + ["--nproc-per-node", "3", "-m", "moe_plugin.cli", "train", "a.yaml", "train.steps=2"]


@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "core-complex"])
def test_cli_passes_the_binding_to_torchrun(numa_ready, launched, mode):
    assert main(["train", "--nproc-per-node", "8", "--numa-binding", mode, "train.steps=2"]) == 0
    assert launched == [TORCHRUN + ["--nproc-per-node", "8", "--numa-binding", mode,
                                    "-m", "moe_plugin.cli", "train", "train.steps=2"]]


def test_torchrun_exit_status_is_returned(numa_ready, monkeypatch):
    monkeypatch.setattr(command.subprocess, "call", lambda argv: 7)
    assert main(["train", "--nproc-per-node", "2", "--numa-binding", "node"]) == 7


@pytest.mark.parametrize("argv, expected", [
    (["--numa-binding", "node"], "--numa-binding=node is applied by torchrun: add --nproc-per-node N"),
    (["--nproc-per-node", "2", "--numa-binding", "rack"], "--numa-binding=rack is invalid: allowed node, socket"),
    (["--nproc-per-node", "0"], "--nproc-per-node=0 is invalid: must be an integer >= 1"),
    (["--nproc-per-node", "2", "moe.num_experts=0"], "MoEConfig.num_experts=0"),   # config errors come first
])
def test_errors_before_any_launch(numa_ready, launched, capsys, argv, expected):
    assert main(["train", *argv]) == 2
    assert expected in capsys.readouterr().err
    assert launched == []


def test_numactl_missing(numa_ready, launched, monkeypatch, capsys):
    monkeypatch.setattr(processes.shutil, "which", lambda name: None)
    assert main(["train", "--nproc-per-node", "2", "--numa-binding", "node"]) == 2
    assert "needs the numactl program" in capsys.readouterr().err and launched == []


def test_no_gpu(numa_ready, launched, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--nproc-per-node", "2", "--numa-binding", "socket"]) == 2
    assert "no CUDA GPU is available here" in capsys.readouterr().err and launched == []


def test_no_nested_launch(numa_ready, launched, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--nproc-per-node", "2"]) == 2
    assert "already runs under a launcher (WORLD_SIZE=2)" in capsys.readouterr().err and launched == []


def test_print_config_does_not_launch(launched, capsys):
    assert main(["train", "--nproc-per-node", "2", "--print-config", "train.steps=3"]) == 0
    assert "steps: 3" in capsys.readouterr().out and launched == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_launch_trains_on_two_processes(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    real_call = subprocess.call
    monkeypatch.setattr(command.subprocess, "call", lambda argv: real_call(argv, timeout=200))
    assert main(["train", "--nproc-per-node", "2", *TINY, "train.steps=2", "train.eval_every=2",
                 f"log.out_dir={out}"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 2
