"""The processes of a run: one, or the ranks of a torchrun launch."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


@dataclass
class Processes:
    rank: int
    world_size: int
    device: torch.device
    started_group: bool


def start_processes(device_choice: str) -> Processes:
    """One process (world size 1), or one rank of a torchrun launch (WORLD_SIZE etc. in the environment)."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' is invalid: no CUDA device is available")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    started = world_size > 1 and not dist.is_initialized()
    if started:
        _init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    return Processes(rank, world_size, device, started)


def _init_process_group(backend: str) -> None:
    """init_process_group from torchrun's environment. After a restart (torchrun --max-restarts) torchrun hands
    the new ranks the store the killed ones used, where their addresses are still written: a new rank that reads
    one before its peer overwrites it connects to a dead process (seen: gloo "connectFullMesh failed ...
    Connection refused"). So every attempt keeps its keys under its own prefix."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend)
        return
    store, rank, world_size = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"moe_plugin/attempt_{restart}", store), rank=rank,
                            world_size=world_size)


def gather(procs: Processes, obj: Any) -> List[Any]:
    if procs.world_size == 1:
        return [obj]
    objects = [None] * procs.world_size
    dist.all_gather_object(objects, obj)
    return objects


def numa_modes() -> Tuple[str, ...]:
    """The values torchrun's --numa-binding takes in this torch (none before torch 2.9)."""
    try:
        from torch.numa.binding import AffinityMode
    except ImportError:
        return ()
    return tuple(mode.value for mode in AffinityMode)


def check_numa_binding(mode: str) -> None:
    """ValueError unless torchrun can bind ranks to NUMA nodes here in `mode`."""
    modes = numa_modes()
    if not modes:
        raise ValueError(f"--numa-binding={mode} needs torchrun's NUMA binding, which torch {torch.__version__} "
                         f"lacks (torch >= 2.9)")
    if mode not in modes:
        raise ValueError(f"--numa-binding={mode} is invalid: allowed {', '.join(modes)}")
    if shutil.which("numactl") is None:
        raise ValueError(f"--numa-binding={mode} needs the numactl program (torchrun starts each rank under "
                         f"`numactl --physcpubind=...`), and it is not on PATH; install it (Debian/Ubuntu: "
                         f"apt-get install numactl)")
    if not torch.cuda.is_available():
        raise ValueError(f"--numa-binding={mode} binds local rank i to the CPUs of the NUMA node of GPU cuda:i, "
                         f"and no CUDA GPU is available here")


# torchrun's own list plus SIGUSR1 (SLURM's early warning): torchrun hands each to the ranks (train/faults.py)
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def torchrun_command(nproc_per_node: int, numa_binding: Optional[str], train_arguments: Sequence[str],
                     max_restarts: Optional[int] = None) -> List[str]:
    """The torchrun command line that runs `moe-plugin train train_arguments` on nproc_per_node local
    processes (one node; torchrun picks a free port); max_restarts: torchrun's --max-restarts. torchrun is run
    through moe_plugin.train.torchrun, which ends in the ranks' one line where they stopped on purpose."""
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={nproc_per_node} is invalid: must be an integer >= 1")
    if "WORLD_SIZE" in os.environ:
        raise ValueError(f"--nproc-per-node starts torchrun, but this process already runs under a launcher "
                         f"(WORLD_SIZE={os.environ['WORLD_SIZE']}); pass --numa-binding to that torchrun instead")
    if max_restarts is not None and (isinstance(max_restarts, bool) or not isinstance(max_restarts, int)
                                     or max_restarts < 0):
        raise ValueError(f"--max-restarts={max_restarts} is invalid: must be an integer >= 0")
    command = [sys.executable, "-m", "moe_plugin.train.torchrun", "--standalone", "--signals-to-handle", TORCHRUN_SIGNALS,
               "--nproc-per-node", str(nproc_per_node)]
    if max_restarts is not None:
        command += ["--max-restarts", str(max_restarts)]
    if numa_binding is not None:
        check_numa_binding(numa_binding)
        command += ["--numa-binding", numa_binding]
    return command + ["-m", "moe_plugin.cli", "train", *train_arguments]
