"""Merge the per-rank checkpoints of an expert-parallel run into one single-process checkpoint, or
reshard them to another --moe-ep-size.

With --moe-ep-size N > 1 every rank saves its own checkpoint (checkpoint_last-rank-<R>.pt, see
models.py) holding the shared weights and its own experts. This writes one checkpoint with all
experts and moe_ep_size 1, which fairseq-eval-lm, fairseq-generate and fairseq-train (with
--reset-optimizer) load on a single process:

    python -m moe_plugin.integrations.fairseq_moe.consolidate SAVE_DIR/checkpoint_last-rank-0.pt OUT.pt

or, with --ep-size M > 1 (and --world-size W, a multiple of M; default M), the W per-rank
checkpoints OUT_DIR/checkpoint_last-rank-<R>.pt of a run with --moe-ep-size M on W processes:

    python -m moe_plugin.integrations.fairseq_moe.consolidate SAVE_DIR/checkpoint_last-rank-0.pt OUT_DIR --ep-size 4

Shared weights come from rank 0; each expert tensor is concatenated over ranks 0 .. N-1 (one
expert-parallel group; the other groups hold copies) and, to reshard, cut into M equal blocks of
experts: rank R gets block R % M. Optimizer state is left out (its expert moments are per rank and
fairseq keys them by parameter position), so fairseq-train resumes such a checkpoint with the
weights only: a fresh optimizer, LR schedule and update count, as with --reset-optimizer.
(`moe-plugin train` checkpoints reshard with their optimizer state: moe_plugin/train/checkpoint.py.)

It writes no file that exists unless given --overwrite, and never over the run's own per-rank checkpoints
(the <name>-rank-<R>.pt beside the source, which hold the optimizer state): reshard into another folder. Each file
is written to a temporary file beside it, then renamed into place. A missing, truncated or foreign rank file, or a
destination refused, ends in one line and exit status 2.
"""
import argparse
import copy
import os
import pickle
import re
import sys
import tempfile
from typing import List, Optional

import torch

from moe_plugin.experts import WEIGHT_NAMES

EXPERT_TENSORS = tuple(f"experts.{name}" for name in WEIGHT_NAMES)


def rank_paths(rank0_path: str, ep_size: int) -> List[str]:
    match = re.fullmatch(r"(.*-rank-)0(\.pt)", rank0_path)
    if not match:
        raise ValueError(f"{rank0_path} is not a rank-0 checkpoint (expected a name ending in -rank-0.pt)")
    return [f"{match.group(1)}{rank}{match.group(2)}" for rank in range(ep_size)]


def load(path: str) -> dict:
    """A fairseq checkpoint of an MoE model; ValueError naming the file and what is wrong with it."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file (every rank's checkpoint of the run is needed)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as error:
        reason = str(error).split(". ")[0].strip() or type(error).__name__
        raise ValueError(f"{path}: cannot be read as a checkpoint, it may be truncated or not a torch file "
                         f"({reason})") from None
    cfg = state.get("cfg") if isinstance(state, dict) and "model" in state else None
    model_args = cfg.get("model") if hasattr(cfg, "get") else None
    if getattr(model_args, "moe_ep_size", None) is None:
        raise ValueError(f"{path}: not a fairseq checkpoint of an MoE model (no model with cfg.model.moe_ep_size)")
    return state


def merged(rank0_path: str):
    """(rank 0's checkpoint, its model with every expert, the ep_size merged over)."""
    first = load(rank0_path)
    model_args = first["cfg"]["model"]
    ep_size, num_experts = model_args.moe_ep_size, model_args.moe_expert_count
    if ep_size > num_experts:
        raise ValueError(f"--moe-ep-size {ep_size} > --moe-expert-count {num_experts} slices each expert over "
                         f"ranks; merging sliced experts is not supported")
    others = rank_paths(rank0_path, ep_size)[1:]
    for path in others:     # every file there before any is read: a missing one is named at once
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file (the run had --moe-ep-size {ep_size}: every rank's checkpoint "
                             f"is needed)")
    states = [first["model"]] + [load(path)["model"] for path in others]
    merged_model = {}
    for key, value in first["model"].items():
        if key.endswith(EXPERT_TENSORS):
            merged_model[key] = torch.cat([state[key] for state in states], dim=0)
        else:
            merged_model[key] = value
    return first, merged_model, ep_size


def check_destinations(rank0_path: str, paths: List[str], overwrite: bool = False) -> None:
    """ValueError unless every path may be written: none is one of the source run's per-rank checkpoints (the
    <name>-rank-<R>.pt beside rank0_path), and none exists unless overwrite."""
    prefix = os.path.realpath(rank0_path)[:-len("0.pt")]
    for path in paths:
        real = os.path.realpath(path)
        if re.fullmatch(re.escape(prefix) + r"\d+\.pt", real):
            raise ValueError(f"{path} is one of the source run's checkpoints (which hold its optimizer state); "
                             f"write to another file or folder")
        if os.path.isdir(path):
            raise ValueError(f"{path} is a folder; give a file name (or --ep-size M > 1 to write per-rank files)")
        if os.path.exists(path) and not overwrite:
            raise ValueError(f"{path} exists; pass --overwrite to replace it, or write elsewhere")


def consolidate(rank0_path: str, out_path: str, overwrite: bool = False) -> int:
    """Write the merged checkpoint; returns the ep_size merged over."""
    rank_paths(rank0_path, 1)
    check_destinations(rank0_path, [out_path], overwrite)
    first, model, ep_size = merged(rank0_path)
    _write(first, model, 1, "", out_path)
    return ep_size


def reshard(rank0_path: str, out_dir: str, new_ep_size: int, world_size: Optional[int] = None,
            overwrite: bool = False) -> List[str]:
    """Write the per-rank checkpoints of a run with --moe-ep-size new_ep_size on world_size processes."""
    world_size = world_size or new_ep_size
    name = os.path.basename(rank_paths(rank0_path, 1)[0])[:-len("-rank-0.pt")]
    suffixes = [f"-rank-{rank}" for rank in range(world_size)] if new_ep_size > 1 else [""]
    check_destinations(rank0_path, [os.path.join(out_dir, f"{name}{suffix}.pt") for suffix in suffixes], overwrite)
    first, model, _ = merged(rank0_path)
    num_experts = first["cfg"]["model"].moe_expert_count
    if new_ep_size < 1 or num_experts % new_ep_size:
        raise ValueError(f"--ep-size {new_ep_size} is invalid: must divide --moe-expert-count {num_experts} "
                         f"(ep sizes above the expert count slice experts, which resharding does not do)")
    if world_size % new_ep_size:
        raise ValueError(f"--world-size {world_size} is invalid: must be a multiple of --ep-size {new_ep_size}")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for rank in range(world_size):
        block = rank % new_ep_size
        local = {key: value.chunk(new_ep_size, dim=0)[block].clone() if key.endswith(EXPERT_TENSORS) else value
                 for key, value in model.items()}
        suffix = f"-rank-{rank}" if new_ep_size > 1 else ""
        paths.append(os.path.join(out_dir, f"{name}{suffix}.pt"))
        _write(first, local, new_ep_size, suffix, paths[-1])
        if new_ep_size == 1:
            break
    return paths


def _write(first: dict, model: dict, ep_size: int, suffix: str, path: str) -> None:
    """first with this model and ep_size, written atomically (a temporary file beside it, renamed into place)."""
    state = dict(first, model=model)
    state["cfg"] = copy.deepcopy(first["cfg"])
    state["cfg"]["model"].moe_ep_size = ep_size
    state["cfg"]["model"].base_layers = 1 if ep_size > 1 else 0   # fairseq's switch for per-rank checkpoints
    state["cfg"]["checkpoint"]["checkpoint_suffix"] = suffix
    state.pop("last_optimizer_state", None)
    handle, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rank0_checkpoint", help="the rank-0 checkpoint, e.g. SAVE_DIR/checkpoint_last-rank-0.pt")
    parser.add_argument("out", help="where to write the merged checkpoint (with --ep-size M > 1: a folder)")
    parser.add_argument("--ep-size", type=int, default=1, help="the --moe-ep-size to reshard to (default 1: merge)")
    parser.add_argument("--world-size", type=int, default=None, help="the processes of the resumed run "
                                                                        "(a multiple of --ep-size; default: --ep-size)")
    parser.add_argument("--overwrite", action="store_true", help="replace destination files that exist (never the "
                                                                 "source run's own checkpoints)")
    args = parser.parse_args(argv)
    try:
        if args.ep_size == 1 and args.world_size in (None, 1):
            ep_size = consolidate(args.rank0_checkpoint, args.out, args.overwrite)
            print(f"merged the experts of {ep_size} ranks into {args.out}")
        else:
            paths = reshard(args.rank0_checkpoint, args.out, args.ep_size, args.world_size, args.overwrite)
            print(f"resharded the experts to --moe-ep-size {args.ep_size}: {len(paths)} checkpoints in {args.out}")
    except ValueError as error:
        print(f"consolidate: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
