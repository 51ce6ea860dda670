"""Run a function on W gloo processes started from the test, or `moe-plugin train` under torchrun; a hang or a crash
fails the test."""
import io
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Workers fork from one server process per test session that imported torch, the package and the hosts once (the
# forkserver start method; helpers.preload), instead of each starting a fresh interpreter as spawn does (~3 s of CPU
# per worker on this machine, 5 with transformers and DeepSpeed). Like spawn, each worker is a fresh fork that has
# run none of the test's code; it gets the test's environment as it was at the call (the server's is the one from
# its own start).
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "moe_plugin", "helpers.preload"])


def _worker(rank, world_size, port, fn, args, queue, environ):
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, _packed(fn(rank, world_size, *args)), None))
    except BaseException:  # reported to the parent, which fails the test with it
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _packed(value) -> bytes:
    """The result as bytes: a tensor put on the queue as it is travels as a handle to this process's shared memory,
    which the parent can no longer open once this process has exited (ConnectionResetError, FileNotFoundError)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def run_workers(fn, world_size: int, *args, timeout: float = 120.0):
    """fn(rank, world_size, *args) on every rank; returns the list of results by rank."""
    queue = CONTEXT.Queue()
    port = _free_port()
    procs = [CONTEXT.Process(target=_worker, args=(rank, world_size, port, fn, args, queue, dict(os.environ)))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, value, error = queue.get(timeout=timeout)
            results[rank] = None if error else torch.load(io.BytesIO(value), weights_only=False)
            if error:
                errors.append(f"rank {rank}:\n{error}")
                break
    except Exception as error:  # queue.Empty: some rank hung
        errors.append(f"no answer within {timeout} s from ranks {sorted(set(range(world_size)) - set(results))}"
                      f" ({type(error).__name__})")
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.1)
            if proc.is_alive():
                proc.terminate()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[rank] for rank in range(world_size)]


def torchrun(*arguments, cwd=None, env=None, timeout=500) -> None:
    """`torchrun --standalone --nproc_per_node 2 *arguments`, one thread per process (env adds to this process's
    environment); fails the test, showing the output's tail, unless it exits 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *arguments]
    done = subprocess.run(command, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def torchrun_train(out: Path, *arguments, timeout=200):
    """`moe-plugin train *arguments` under torchrun on 2 processes writing to out (which must not be the
    working folder): (result.json, the metrics.jsonl records)."""
    root = Path(__file__).resolve().parents[2]
    torchrun("-m", "moe_plugin.cli", "train", *arguments, f"log.out_dir={out}", cwd=out.parent,
             env={"PYTHONPATH": str(root)}, timeout=timeout)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "result.json").read_text()), records
