"""The `moe-plugin train` command line."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from .checkpoint import check_out_dir
from .checks import load_config
from .config import to_yaml
from .faults import NONFINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, NonFiniteStep, Preempted
from .hf_model import hf_moe_config
from .loop import train
from .processes import torchrun_command


def split_arguments(arguments: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """[CONFIG.yaml] and key=value overrides, in any order."""
    paths = [a for a in arguments if "=" not in a]
    if len(paths) > 1:
        raise ValueError(f"expected one config file and key=value overrides, got files {paths}")
    return (paths[0] if paths else None), [a for a in arguments if "=" in a]


def with_effective_moe(cfg):
    """cfg with its moe section as the layers will run it: with an `hf` section, the keys the HF config
    fixes (num_experts, top_k, activation, ...) show the HF config's values, not the defaults. An image
    classifier's (data.task=image) is shown as given: its MLPs' widths differ from stage to stage."""
    if cfg.hf is None or cfg.data.task == "image":
        return cfg
    effective = hf_moe_config(cfg).to_dict()
    cfg.moe = {key: effective.get(key, value) for key, value in cfg.moe.items()}
    return cfg


def add_arguments(parser) -> None:
    parser.add_argument("arguments", nargs="*", metavar="CONFIG.yaml | key=value",
                        help="an experiment config (default: the built-in configs/experiments/default.yaml) "
                             "and overrides such as moe.num_experts=16 train.steps=200")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="start N processes on this node under torchrun (--standalone), each running this "
                             "command; for several nodes run torchrun yourself")
    parser.add_argument("--numa-binding", metavar="MODE",
                        help="with --nproc-per-node: torchrun binds each rank to the CPUs near its GPU "
                             "(node, socket, exclusive or core-complex; needs numactl and CUDA GPUs)")
    parser.add_argument("--max-restarts", type=int, metavar="N",
                        help="with --nproc-per-node: torchrun restarts every rank up to N times after a failure; "
                             "with train.resume=auto each restart continues from the newest whole checkpoint")


def one_thread_unless_set() -> None:
    """torch.set_num_threads(1) unless OMP_NUM_THREADS says otherwise (torchrun's default for each process, too).
    torch's default, one thread per core, collapses on a busy machine: 60 steps of the default experiment took
    100 s with 2 threads on a loaded 2-core machine and 16 s with 1; the small default model gains little from
    a second thread on an idle one."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


@contextlib.contextmanager
def forwarding_signals():
    """SIGTERM and SIGUSR1 to this launcher go on to its children (torchrun, which hands them to the ranks:
    they save and stop) instead of ending the launcher and leaving torchrun behind."""
    def forward(number, _frame):
        for children in Path("/proc/self/task").glob("*/children"):   # Linux; elsewhere nothing is forwarded
            for pid in children.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), number)
    previous = {number: signal.signal(number, forward) for number in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def launch_world(nproc_per_node: int) -> Tuple[int, str]:
    """load_config's world for `--nproc-per-node N` (one node: N processes): parallel.ep_size is checked against it
    as the config is read, before torchrun starts."""
    return nproc_per_node, f"--nproc-per-node {nproc_per_node}; start N with --nproc-per-node N"


def check_launch(cfg, nproc_per_node: int) -> None:
    """The rest of what the ranks would refuse at start, found before torchrun starts them: parallel.fsdp against
    the world of nproc_per_node processes, and log.out_dir (parallel.ep_size: load_config with launch_world)."""
    if cfg.parallel.fsdp and nproc_per_node == 1:
        raise ValueError("parallel.fsdp=true is invalid with --nproc-per-node 1: FSDP2 shards over >= 2 processes; "
                         "give --nproc-per-node N, N >= 2, or set parallel.fsdp=false")
    check_out_dir(cfg)


def main(args) -> int:
    try:
        launching = args.nproc_per_node is not None and not args.print_config
        # torchrun's flags first, then the config against the world they make (one node: nproc_per_node processes)
        command = torchrun_command(args.nproc_per_node, args.numa_binding, args.arguments, args.max_restarts) \
            if launching else None
        cfg = load_config(*split_arguments(args.arguments), world=launch_world(args.nproc_per_node) if launching else None)
        if args.print_config:
            print(to_yaml(with_effective_moe(cfg)), end="")
            return 0
        if args.numa_binding is not None and args.nproc_per_node is None:
            raise ValueError(f"--numa-binding={args.numa_binding} is applied by torchrun: add --nproc-per-node N, "
                             f"or launch `torchrun --numa-binding={args.numa_binding} --nproc-per-node N -m "
                             f"moe_plugin.cli train ...` yourself")
        if args.max_restarts is not None and args.nproc_per_node is None:
            raise ValueError(f"--max-restarts={args.max_restarts} is applied by torchrun: add --nproc-per-node N, "
                             f"or launch `torchrun --max-restarts {args.max_restarts} --nproc-per-node N -m "
                             f"moe_plugin.cli train ... train.resume=auto` yourself")
        if launching:
            check_launch(cfg, args.nproc_per_node)
            with forwarding_signals():
                return subprocess.call(command)
    except ValueError as error:
        _say(error)
        return 2
    one_thread_unless_set()
    try:
        train(cfg)
    except ValueError as error:  # a user error found once the processes are known (ep_size, resume)
        _say(error)
        return 2
    except Preempted:   # rank 0 has said where the checkpoint is
        return PREEMPTED_EXIT_CODE
    except NonFiniteStep as error:
        _say(error)
        return NONFINITE_EXIT_CODE
    return 0


def _say(error) -> None:
    """The error's one line, written at once: every rank says it, and print's two writes (the text, then its newline)
    from two ranks interleave in a shared log."""
    sys.stderr.write(f"moe-plugin train: {error}\n")
