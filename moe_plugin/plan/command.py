"""`moe-plugin plan [CONFIG.yaml] [key=value ...] --world-size N`: a `moe-plugin train` experiment's per-rank
memory, all-to-all traffic and step time, without starting the processes."""
from __future__ import annotations

import json
import sys

from ..train import load_config, split_arguments
from .devices import DEVICES, device
from .experiment import plan_experiment
from .report import as_json, as_text


def add_arguments(parser) -> None:
    parser.add_argument("arguments", nargs="*", metavar="CONFIG.yaml | key=value",
                        help="the experiment as `moe-plugin train` takes it (default: the built-in default "
                             "experiment) and overrides such as parallel.ep_size=8")
    parser.add_argument("--world-size", type=int, required=True, metavar="N", help="processes of the run")
    parser.add_argument("--node-size", type=int, default=8, metavar="M", help="processes per node (default 8)")
    parser.add_argument("--device", default="h100", metavar="NAME",
                        help=f"the device profile: {', '.join(DEVICES)} (default h100)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def main(args) -> int:
    try:
        profile = device(args.device)
        cfg = load_config(*split_arguments(args.arguments))
        node_size = min(args.node_size, args.world_size) if args.world_size >= 1 else args.node_size
        plan = plan_experiment(cfg, args.world_size, node_size, profile)
    except ValueError as error:
        print(f"moe-plugin plan: {error}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"moe-plugin plan: warning: {warning}", file=sys.stderr)
    print(json.dumps(as_json(plan)) if args.json else as_text(plan), end="\n" if args.json else "")
    return 0
