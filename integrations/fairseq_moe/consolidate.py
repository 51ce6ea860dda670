"""Merge the per-rank checkpoints of an expert-parallel run into one single-process checkpoint.

With --moe-ep-size N > 1 every rank saves its own checkpoint (checkpoint_last-rank-<R>.pt, see
models.py) holding the shared weights and its own experts. This writes one checkpoint with all
experts and moe_ep_size 1, which fairseq-eval-lm, fairseq-generate and fairseq-train (with
--reset-optimizer) load on a single process:

    python -m moe_plugin.integrations.fairseq_moe.consolidate SAVE_DIR/checkpoint_last-rank-0.pt OUT.pt

Shared weights come from rank 0; each expert tensor is concatenated over ranks 0 .. N-1 (one
expert-parallel group; the other groups hold copies). Optimizer state is left out.
"""
import argparse
import re
import sys
from typing import List, Optional

import torch

EXPERT_TENSORS = ("experts.w1_EDH", "experts.b1_EH", "experts.w2_EHD", "experts.b2_ED")


def rank_paths(rank0_path: str, ep_size: int) -> List[str]:
    match = re.fullmatch(r"(.*-rank-)0(\.pt)", rank0_path)
    if not match:
        raise ValueError(f"{rank0_path} is not a rank-0 checkpoint (expected a name ending in -rank-0.pt)")
    return [f"{match.group(1)}{rank}{match.group(2)}" for rank in range(ep_size)]


def consolidate(rank0_path: str, out_path: str) -> int:
    """Write the merged checkpoint; returns the ep_size merged over."""
    first = torch.load(rank0_path, map_location="cpu", weights_only=False)
    model_args = first["cfg"]["model"]
    ep_size, num_experts = model_args.moe_ep_size, model_args.moe_expert_count
    if ep_size > num_experts:
        raise ValueError(f"--moe-ep-size {ep_size} > --moe-expert-count {num_experts} slices each expert over "
                         f"ranks; merging sliced experts is not supported")
    states = [first["model"]] + [torch.load(path, map_location="cpu", weights_only=False)["model"]
                                 for path in rank_paths(rank0_path, ep_size)[1:]]
    merged = {}
    for key, value in first["model"].items():
        if key.endswith(EXPERT_TENSORS):
            merged[key] = torch.cat([state[key] for state in states], dim=0)
        else:
            merged[key] = value
    model_args.moe_ep_size = 1
    model_args.base_layers = 0
    first["model"] = merged
    first["cfg"]["checkpoint"]["checkpoint_suffix"] = ""
    first.pop("last_optimizer_state", None)
    torch.save(first, out_path)
    return ep_size


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rank0_checkpoint", help="the rank-0 checkpoint, e.g. SAVE_DIR/checkpoint_last-rank-0.pt")
    parser.add_argument("out", help="where to write the merged checkpoint")
    args = parser.parse_args(argv)
    ep_size = consolidate(args.rank0_checkpoint, args.out)
    print(f"merged the experts of {ep_size} ranks into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
