"""Run a function on W gloo processes spawned from the test; a hang or a crash fails the test."""
import os
import socket
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, fn(rank, world_size, *args), None))
    except BaseException:  # reported to the parent, which fails the test with it
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn, world_size: int, *args, timeout: float = 120.0):
    """fn(rank, world_size, *args) on every rank; returns the list of results by rank."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_worker, args=(rank, world_size, port, fn, args, queue))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, value, error = queue.get(timeout=timeout)
            results[rank] = value
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
