"""`moe-plugin plan [CONFIG.yaml] [key=value ...] --world-size N`: a `moe-plugin train` experiment's per-rank
memory, all-to-all traffic and step time, without starting the processes; with `--deepspeed ds.json --hf-config
config.json --seq-len S`, a DeepSpeed run's (moe_plugin.integrations.deepspeed.plan)."""
from __future__ import annotations

import contextlib
import json
import sys

from ..train import load_config, split_arguments
from .devices import DEVICES, device
from .experiment import DEFAULT_NODE_SIZE, node_size_of, plan_experiment
from .report import as_json, as_text
from .skew import read_skew


def add_arguments(parser) -> None:
    parser.add_argument("arguments", nargs="*", metavar="CONFIG.yaml | key=value",
                        help="the experiment as `moe-plugin train` takes it (default: the built-in default "
                             "experiment) and overrides such as parallel.ep_size=8")
    parser.add_argument("--world-size", type=int, required=True, metavar="N", help="processes of the run")
    parser.add_argument("--node-size", type=int, metavar="M",
                        help=f"processes per node (default {DEFAULT_NODE_SIZE}, or --world-size when smaller)")
    parser.add_argument("--device", default="h100", metavar="NAME",
                        help=f"the device profile: {', '.join(DEVICES)} (default h100)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--skew", metavar="S | routing.json",
                        help="routing not even: the busiest expert-parallel rank's rows over the mean rank's "
                             "(max_rank_load, a number >= 1: rank 0's experts take that share), or a routing report "
                             "(`moe-plugin checkpoint routing`'s routing.json); the step charges the busiest rank and "
                             "the replicas (moe.redundant_experts) with their traffic")
    parser.add_argument("--deepspeed", metavar="DS.json",
                        help="plan a DeepSpeed run with this config (its \"moe\" section, micro-batch, precision and "
                             "ZeRO stage) instead of a train experiment; needs --hf-config and --seq-len")
    parser.add_argument("--hf-config", metavar="CONFIG.json", help="with --deepspeed: the Hugging Face model's local "
                                                                    "config.json (or its folder)")
    parser.add_argument("--seq-len", type=int, metavar="S", help="with --deepspeed: tokens per row")


def plan_deepspeed_run(args, profile, node_size):
    """--deepspeed: the DeepSpeed adapter's plan (ValueError for a missing or misplaced flag)."""
    if args.arguments:
        raise ValueError(f"--deepspeed plans a DeepSpeed run: leave out the experiment arguments {args.arguments}")
    if not args.hf_config:
        raise ValueError("--deepspeed needs --hf-config CONFIG.json (the Hugging Face model's local config)")
    if args.seq_len is None or args.seq_len < 1:
        raise ValueError(f"--deepspeed needs --seq-len S, an integer >= 1 (tokens per row), got {args.seq_len}")
    try:
        with contextlib.redirect_stdout(sys.stderr):     # DeepSpeed's logger, made at import, prints: not on stdout
            from ..integrations.deepspeed.plan import plan_deepspeed   # optional: needs DeepSpeed and transformers
    except ImportError as error:
        raise ValueError(f"--deepspeed needs DeepSpeed and transformers ({error}); install them with: pip install "
                         f"'moe_plugin[deepspeed,transformers]'") from None
    return plan_deepspeed(args.deepspeed, args.hf_config, args.world_size, node_size, args.seq_len, profile)


def main(args) -> int:
    try:
        profile = device(args.device)
        node_size = node_size_of(args.world_size, args.node_size)
        if args.deepspeed is not None:
            if args.skew is not None:
                raise ValueError("--skew plans a train experiment; with --deepspeed it is not read yet")
            plan = plan_deepspeed_run(args, profile, node_size)
        else:
            if args.hf_config is not None or args.seq_len is not None:
                raise ValueError("--hf-config and --seq-len go with --deepspeed; a train experiment sets the model "
                                 "in its hf section and model.seq_len")
            cfg = load_config(*split_arguments(args.arguments), world=(args.world_size, "plan with --world-size N"))
            plan = plan_experiment(cfg, args.world_size, node_size, profile,
                                   None if args.skew is None else read_skew(args.skew))
    except ValueError as error:
        print(f"moe-plugin plan: {error}", file=sys.stderr)
        return 2
    for warning in plan.warnings:
        print(f"moe-plugin plan: warning: {warning}", file=sys.stderr)
    print(json.dumps(as_json(plan)) if args.json else as_text(plan), end="\n" if args.json else "")
    return 0
