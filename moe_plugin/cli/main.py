"""The `moe-plugin` command: train, checkpoint, bench, info."""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import List, Optional

import torch

from .. import __version__, ops, plan, train
from . import bench
from ..train import convert


# what the extras of setup.py bring, by import name (scikit-learn imports as sklearn)
OPTIONAL = ("deepspeed", "fairseq", "omegaconf", "triton", "transformers", "accelerate", "peft", "sklearn",
            "matplotlib")


def _installed_version(name: str, distributions) -> str:
    """'<distribution> <version>' of an importable name, without importing it; 'not installed' otherwise."""
    if importlib.util.find_spec(name) is None:
        return "not installed"
    found = [f"{dist} {importlib.metadata.version(dist)}" for dist in distributions.get(name, [])]
    return ", ".join(found) or "installed (version unknown)"


def info(_: argparse.Namespace) -> int:
    print(f"moe_plugin {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cuda {'available' if torch.cuda.is_available() else 'not available'}")
    distributions = importlib.metadata.packages_distributions()   # import name -> installed distributions
    for name in OPTIONAL:
        print(f"{name}: {_installed_version(name, distributions)}")
    print(f"kernels ({ops.ENV}={os.environ.get(ops.ENV, 'auto')}):")
    for device, active in ops.describe().items():
        print(f"  {device}: {active}")
    return 0


def fairseq_user_dir(_: argparse.Namespace) -> int:
    """Print the folder to pass to fairseq's --user-dir (found without importing fairseq)."""
    spec = importlib.util.find_spec("moe_plugin.integrations.fairseq_moe")
    if spec is None or not spec.submodule_search_locations:
        print("moe_plugin.integrations.fairseq_moe is not installed", file=sys.stderr)
        return 1
    print(list(spec.submodule_search_locations)[0])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-plugin", description="A fast Mixture-of-Experts layer for PyTorch.")
    parser.add_argument("--version", action="version", version=f"moe_plugin {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train a small MoE transformer LM from a YAML experiment config")
    train.add_arguments(train_parser)
    train_parser.set_defaults(func=train.main)
    checkpoint_parser = commands.add_parser("checkpoint", help="inspect a checkpoint of `moe-plugin train`, or "
                                            "convert it to one full state-dict file and back")
    convert.add_arguments(checkpoint_parser)
    checkpoint_parser.set_defaults(func=convert.main)
    bench_parser = commands.add_parser(
        "bench", help="time one MoE layer against the bare GEMMs and peers",
        description="Time one MoE layer's forward+backward against the bare expert GEMMs and peers, interleaved in "
        "one run. The default shape (T 4096, D 1024, H 4096, 8 experts) takes a few minutes on a 2-core CPU; "
        "for a quick look use e.g. --tokens 512 --model-dim 256 --hidden-size 512 --rounds 2.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.main)
    plan_parser = commands.add_parser("plan", help="each rank's memory, all-to-all traffic and step time of a run "
                                      "at any world size, without starting it (docs/planning.md)")
    plan.add_arguments(plan_parser)
    plan_parser.set_defaults(func=plan.main)
    commands.add_parser("info", help="versions, optional dependencies and the active kernels").set_defaults(func=info)
    commands.add_parser("fairseq-user-dir", help="print the path to pass to fairseq's --user-dir").set_defaults(
        func=fairseq_user_dir)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)

