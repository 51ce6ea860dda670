"""Shared by the fairseq tests: a generated corpus, and fairseq's commands run as subprocesses."""
import contextlib
import importlib.util
import io
import json
import os
import random
import re
import socket
import subprocess
import sys

import pytest

from moe_plugin.cli import main as moe_plugin_main

needs_fairseq = pytest.mark.skipif(
    importlib.util.find_spec("fairseq") is None,
    reason="fairseq is not installed (PIP_CONSTRAINT=constraints.txt pip install fairseq-fixed==0.12.3.1)")

# 2 layers, both MoE, 4 experts: small enough for 30 updates in seconds on one CPU core
TINY_LM = ["--arch", "transformer_lm_moe", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
           "--decoder-layers", "2", "--decoder-attention-heads", "2", "--moe-expert-count", "4", "--moe-freq", "1"]
TINY_MT = ["--arch", "transformer_iwslt_de_en_moe", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
           "--encoder-layers", "2", "--encoder-attention-heads", "2", "--decoder-embed-dim", "32",
           "--decoder-ffn-embed-dim", "64", "--decoder-layers", "2", "--decoder-attention-heads", "2",
           "--share-all-embeddings", "--moe-expert-count", "4", "--moe-freq", "1"]
CPU = ["--cpu", "--num-workers", "0", "--seed", "1", "--log-format", "simple", "--log-interval", "1",
       "--required-batch-size-multiple", "1"]


def user_dir() -> str:
    """The path `moe-plugin fairseq-user-dir` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert moe_plugin_main(["fairseq-user-dir"]) == 0
    return out.getvalue().strip()


def fairseq(module: str, args, cwd, timeout: float = 240, check: bool = True, env=None):
    """python -m fairseq_cli.<module> args; returns the CompletedProcess (stdout and stderr together)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", f"fairseq_cli.{module}"] + [str(a) for a in args], cwd=cwd,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"fairseq_cli.{module} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


# `python -m module args` for each (module, args) of argv[1] (JSON) in turn, in this one interpreter, each as -m runs
# it (runpy, as __main__, with its own sys.argv): an uncaught exception's traceback and exit status 1, SystemExit's
# status, and on to the next; START and END lines (with the status) around each. The logging handlers a command
# adds (fairseq's to stdout and to files) are taken away after it, as its process's end would.
_RUN_MODULES = """\
import json, logging, runpy, sys, traceback
loggers = lambda: [logging.root] + [x for x in logging.root.manager.loggerDict.values() if isinstance(x, logging.Logger)]
for module, argv in json.loads(sys.argv[1]):
    handlers = dict((logger, list(logger.handlers)) for logger in loggers())
    print({start!r} + module)
    sys.argv, status = [module] + argv, 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        status = done.code if isinstance(done.code, int) else int(done.code is not None)
    except Exception:
        traceback.print_exc()
        status = 1
    print({end!r} + str(status))
    for logger in loggers():
        for handler in set(logger.handlers) - set(handlers.get(logger, [])):
            handler.close()
        logger.handlers = handlers.get(logger, [])
"""
_START, _END = "=== python -m ", "=== exit status "


def run_modules(commands, cwd, timeout: float = 240, check: bool = True) -> list:
    """`python -m module args` for each (module, args) of commands, one after another in one interpreter (unbuffered,
    so that the output keeps its order): fairseq and torch are imported once (~5 s on one CPU core) instead of once
    per command. Returns a CompletedProcess per command: its output (stdout and stderr together) and exit status (1
    for an uncaught exception, whose traceback is in its output). check: fail, showing the output's tail, if any
    command failed."""
    script = _RUN_MODULES.format(start=_START, end=_END)
    commands = [(module, [str(a) for a in args]) for module, args in commands]
    proc = subprocess.run([sys.executable, "-u", "-c", script, json.dumps(commands)], cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    parts = proc.stdout.split(_START)[1:]
    assert proc.returncode == 0 and len(parts) == len(commands), proc.stdout[-6000:]
    done = []
    for (module, args), part in zip(commands, parts):
        name, _, rest = part.partition("\n")
        output, _, status = rest.rpartition(_END)
        assert name == module, proc.stdout[-6000:]
        done.append(subprocess.CompletedProcess([module] + args, int(status), output))
        if check and done[-1].returncode != 0:
            raise AssertionError(f"python -m {module} failed ({done[-1].returncode}):\n{output[-6000:]}")
    return done


def train_losses(log: str) -> dict:
    """{update: loss} from the train_inner lines of a fairseq-train log (--log-interval 1)."""
    losses = {}
    for line in log.splitlines():
        if "| train_inner |" in line:
            update = int(re.search(r"num_updates=(\d+)", line).group(1))
            losses[update] = float(re.search(r" loss=([\d.]+)", line).group(1))
    return losses


def write_corpus(root) -> None:
    """A counting LM corpus (w7 w8 w9 ...) and a word-for-word translation corpus (s3 s1 -> t3 t1)."""
    rng = random.Random(0)
    os.makedirs(root, exist_ok=True)
    for split, lines in (("train", 600), ("valid", 40), ("test", 40)):
        with open(os.path.join(root, f"lm.{split}"), "w") as f:
            for _ in range(lines):
                start, length = rng.randrange(24), rng.randint(6, 14)
                f.write(" ".join(f"w{(start + i) % 24}" for i in range(length)) + "\n")
        with open(os.path.join(root, f"mt.{split}.src"), "w") as src, \
                open(os.path.join(root, f"mt.{split}.tgt"), "w") as tgt:
            for _ in range(lines):
                words = [rng.randrange(16) for _ in range(rng.randint(4, 10))]
                src.write(" ".join(f"s{w}" for w in words) + "\n")
                tgt.write(" ".join(f"t{w}" for w in words) + "\n")


def binarize(root) -> tuple:
    """fairseq-preprocess the corpus; returns (lm data dir, translation data dir)."""
    raw = os.path.join(root, "raw")
    write_corpus(raw)
    lm, mt = os.path.join(root, "data-lm"), os.path.join(root, "data-mt")
    splits = lambda prefix: ["--trainpref", f"{raw}/{prefix}.train", "--validpref", f"{raw}/{prefix}.valid",  # noqa
                             "--testpref", f"{raw}/{prefix}.test", "--workers", "1"]
    run_modules([("fairseq_cli.preprocess", ["--only-source", "--destdir", lm] + splits("lm")),
                 ("fairseq_cli.preprocess", ["--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary",
                                             "--destdir", mt] + splits("mt"))], cwd=root)
    return lm, mt


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_distributed(args, world_size: int, cwd, timeout: float = 240) -> list:
    """fairseq-train on world_size gloo processes (legacy_ddp), one per rank; returns their logs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = []
    for rank in range(world_size):
        rank_args = ["--distributed-init-method", "env://", "--distributed-world-size", world_size,
                     "--distributed-rank", rank, "--distributed-no-spawn", "--distributed-backend", "gloo",
                     "--ddp-backend", "legacy_ddp"]
        procs.append(subprocess.Popen([sys.executable, "-m", "fairseq_cli.train"] + [str(a) for a in args + rank_args],
                                      cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs, failed = [], []
    try:
        for rank, proc in enumerate(procs):
            logs.append(proc.communicate(timeout=timeout)[0])
            if proc.returncode != 0:
                failed.append(f"rank {rank} exited with {proc.returncode}:\n{logs[-1][-4000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        raise AssertionError("\n".join(failed))
    return logs


# fairseq_cli.train as `python -m` runs it, with each MoE layer's training forwards recorded (reference sums of
# tests/helpers/routing_reference.py: from the layer's input and its router's weights as the forward runs) from the
# moment moe_cross_entropy's RoutingMonitor watches the model (the same model and layer names it reports on);
# pickled into argv[1] at exit as ({layer name: [sums of each forward]}, {layer name: MoEConfig}).
_TRAIN_RECORDING = """\
import atexit, pickle, runpy, sys
from helpers.routing_reference import record_forwards
from moe_plugin.routing_monitor import metrics as routing_metrics
out, forwards, layers = sys.argv.pop(1), {}, {}
watch = routing_metrics.RoutingMonitor.__init__
def watch_and_record(monitor, model):
    watch(monitor, model)
    layers.update(record_forwards(model, forwards))
routing_metrics.RoutingMonitor.__init__ = watch_and_record
def dump():
    with open(out, "wb") as file:
        pickle.dump((forwards, {name: layer.config for name, layer in layers.items()}), file)
atexit.register(dump)
sys.argv[0] = "fairseq_cli.train"
runpy.run_module("fairseq_cli.train", run_name="__main__", alter_sys=True)
"""


def train_recording_routing(args, cwd, record, timeout: float = 240):
    """fairseq-train args (one process) with every MoE layer's training forwards recorded into the file record
    (_TRAIN_RECORDING); returns the CompletedProcess (stdout and stderr together), failing on a non-zero exit."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # helpers' folder, on the child's path
    path = os.pathsep.join([tests] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", _TRAIN_RECORDING, str(record)] + [str(a) for a in args], cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"fairseq_cli.train (recording) failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc
