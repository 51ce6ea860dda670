"""Merge the per-rank checkpoints of an expert-parallel fairseq run into one checkpoint, or reshard them to another
--moe-ep-size and world size, with the optimizer state: fairseq-train --restore-file goes on from the result as the
old run would have.

With --moe-ep-size N > 1 every rank saves its own checkpoint (checkpoint_last-rank-<R>.pt, see models.py) holding
the shared weights, its own experts and its optimizer state. This writes one checkpoint with all experts and
moe_ep_size 1, which fairseq-eval-lm, fairseq-generate and fairseq-train (one process, or several at
--moe-ep-size 1: give --world-size) load:

    python -m moe_plugin.integrations.fairseq_moe.consolidate SAVE_DIR/checkpoint_last-rank-0.pt OUT.pt

or, with --ep-size M > 1 (and --world-size W, a multiple of M; default M), the W per-rank checkpoints
OUT_DIR/checkpoint_last-rank-<R>.pt of a run with --moe-ep-size M on W processes:

    python -m moe_plugin.integrations.fairseq_moe.consolidate SAVE_DIR/checkpoint_last-rank-0.pt OUT_DIR --ep-size 4

then `fairseq-train ... --moe-ep-size M --restore-file OUT_DIR/checkpoint_last.pt` on W processes (fairseq adds each
rank's -rank-<R> itself).

What moves: the weights; Adam's state of every parameter (exp_avg, exp_avg_sq, step); the update count and the LR
scheduler's state (optimizer_history); the epoch and the position in it (extra_state's train_iterator: its count of
per-rank batches is rescaled to the new world size, so the resumed run starts at the same global batch when W'
divides W x that count, and otherwise a line says how many batches it sees again). Keep the global batch with
--update-freq: W x update_freq as before. Shared weights and their moments come from rank 0 (every rank's are
checked bit-equal); each expert tensor and its moments are concatenated over ranks 0 .. N-1 (one expert-parallel
group; the other groups hold copies) and, to reshard, cut into M equal blocks of experts: rank R gets block R % M.
The optimizer's index of each parameter is its position among the saved model's keys (buffers and tied copies left
out), checked against the shape of every moment.

Supported: fairseq's Adam (--optimizer adam) in fp32 (no --fp16, --bf16, --amp), --ddp-backend legacy_ddp without
--zero-sharding. Any other optimizer state stops the tool with one line; --weights-only then writes the weights, the
update count's history and the data position without the optimizer state, and fairseq-train restarts the optimizer,
the LR schedule and the update count (as with --reset-optimizer).

It writes no file that exists unless given --overwrite, and never over the run's own per-rank checkpoints (the
<name>-rank-<R>.pt beside the source): reshard into another folder. Each file is written to a temporary file beside
it, then renamed into place. A missing, truncated or foreign rank file, optimizer state it cannot carry, or a
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


SUPPORTED = ("fairseq's Adam (--optimizer adam) in fp32 (no --fp16, --bf16, --amp), --ddp-backend legacy_ddp without "
             "--zero-sharding")
WEIGHTS_ONLY = ("pass --weights-only to reshard the weights alone (fairseq-train then restarts the optimizer, "
                "the LR schedule and the update count)")
# buffers of the models' modules (fairseq's and ours), never optimizer parameters
BUFFERS = ("version", "_float_tensor", "expert_bias_E", "_num_global_experts")


def optimizer_error(state: dict, path: str) -> Optional[str]:
    """Why the optimizer state of this checkpoint cannot be carried (None: it can)."""
    cfg = state["cfg"]
    common = cfg.get("common") or {}
    history = state.get("optimizer_history") or [{}]
    name = history[-1].get("optimizer_name")
    flags = [f"--{flag.replace('_', '-')}" for flag in ("fp16", "bf16", "amp", "memory_efficient_fp16",
                                                         "memory_efficient_bf16") if common.get(flag)]
    sharding = (cfg.get("distributed_training") or {}).get("zero_sharding", "none")
    if "last_optimizer_state" not in state:
        what = "absent (saved with --no-save-optimizer-state, or written with --weights-only)"
    elif flags:
        what = f"that of {' '.join(flags)} (flattened fp32 copies)"
    elif name != "FairseqAdam":
        what = f"that of {name}"
    elif sharding not in (None, "none"):
        what = f"sharded (--zero-sharding {sharding})"
    else:
        return None
    return f"{path}: its optimizer state is {what}; the tool carries {SUPPORTED} only; {WEIGHTS_ONLY}"


def parameter_keys(state: dict, path: str) -> List[str]:
    """The model key of each optimizer index: fairseq's optimizer takes model.parameters() in order, which is the
    order of the parameters among the model's state-dict keys, less buffers (BUFFERS) and tied copies (a key whose
    tensor shares an earlier key's storage). Checked: one parameter group over indices 0 .. n-1, n keys, and every
    moment of index i shaped as key i's tensor; ValueError otherwise."""
    model, optimizer = state["model"], state["last_optimizer_state"]
    keys, seen = [], set()
    for key, value in model.items():
        if key.rsplit(".", 1)[-1] in BUFFERS or not torch.is_tensor(value) or not value.is_floating_point():
            continue
        storage = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if storage in seen:
            continue
        seen.add(storage)
        keys.append(key)
    groups = optimizer.get("param_groups", [])
    indices = [index for group in groups for index in group["params"]]
    problem = None
    if len(groups) != 1 or indices != list(range(len(keys))):
        problem = (f"{len(groups)} parameter group(s) over {len(indices)} indices for the model's {len(keys)} "
                   f"parameters")
    else:
        for index, moments in optimizer["state"].items():
            for field, moment in moments.items():
                if torch.is_tensor(moment) and moment.dim() > 0 and moment.shape != model[keys[index]].shape:
                    problem = (f"the {field} of index {index} is shaped {tuple(moment.shape)}, its parameter "
                               f"{keys[index]} {tuple(model[keys[index]].shape)}")
                    break
            if problem:
                break
    if problem:
        raise ValueError(f"{path}: cannot match the optimizer state to the model's parameters ({problem}); "
                         f"{WEIGHTS_ONLY}")
    return keys


def _check_optimizer(state: dict, path: str) -> None:
    error = optimizer_error(state, path)
    if error:
        raise ValueError(error)


def merged(rank0_path: str, weights_only: bool = False):
    """(rank 0's checkpoint, its model with every expert, its optimizer state with every expert's moments and the
    model key of each optimizer index (parameter_keys), both None if weights_only, the ep_size merged over)."""
    first = load(rank0_path)
    model_args = first["cfg"]["model"]
    ep_size, num_experts = model_args.moe_ep_size, model_args.moe_expert_count
    if ep_size > num_experts:
        raise ValueError(f"--moe-ep-size {ep_size} > --moe-expert-count {num_experts} slices each expert over "
                         f"ranks; merging sliced experts is not supported")
    if not weights_only:
        _check_optimizer(first, rank0_path)
    others = rank_paths(rank0_path, ep_size)[1:]
    for path in others:     # every file there before any is read: a missing one is named at once
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file (the run had --moe-ep-size {ep_size}: every rank's checkpoint "
                             f"is needed)")
    ranks = [first]
    for path in others:
        ranks.append(load(path))
        if not weights_only:
            _check_optimizer(ranks[-1], path)
    merged_model = {}
    for key, value in first["model"].items():
        if key.endswith(EXPERT_TENSORS):
            merged_model[key] = torch.cat([state["model"][key] for state in ranks], dim=0)
        else:
            merged_model[key] = value
    if weights_only:
        return first, merged_model, None, None, ep_size
    paths = [rank0_path] + others
    keys = parameter_keys(first, rank0_path)
    for state, path in zip(ranks[1:], paths[1:]):
        if parameter_keys(state, path) != keys:
            raise ValueError(f"{path}: its parameters differ from {rank0_path}'s (not the same run)")
    merged_state = {}
    for index, key in enumerate(keys):
        per_rank = [state["last_optimizer_state"]["state"].get(index) for state in ranks]
        if all(moments is None for moments in per_rank):
            continue        # never stepped (no gradient yet)
        if any(moments is None or set(moments) != set(per_rank[0]) for moments in per_rank):
            raise ValueError(f"{paths[0]}: the ranks' optimizer states of {key} hold different fields")
        merged_state[index] = {}
        for field, value in per_rank[0].items():
            if key.endswith(EXPERT_TENSORS) and torch.is_tensor(value) and value.dim() > 0:
                merged_state[index][field] = torch.cat([moments[field] for moments in per_rank], dim=0)
                continue
            for moments, path in zip(per_rank[1:], paths[1:]):
                other = moments[field]
                same = (torch.is_tensor(value) and torch.is_tensor(other) and value.shape == other.shape
                        and torch.equal(value, other)) or (not torch.is_tensor(value) and value == other)
                if not same:
                    raise ValueError(f"{path}: the {field} of the replicated parameter {key} differs from rank 0's "
                                     f"(a run's ranks hold equal copies); these files are not one run's")
            merged_state[index][field] = value
    optimizer = dict(first["last_optimizer_state"], state=merged_state)
    return first, merged_model, optimizer, keys, ep_size


def local_optimizer(optimizer: dict, keys: List[str], ep_size: int, block: int) -> dict:
    """The optimizer state of the rank holding block `block` of ep_size blocks of experts."""
    state = {}
    for index, moments in optimizer["state"].items():
        expert = keys[index].endswith(EXPERT_TENSORS)
        state[index] = {field: value.chunk(ep_size, dim=0)[block].clone()
                        if expert and torch.is_tensor(value) and value.dim() > 0 else value
                        for field, value in moments.items()}
    return dict(optimizer, state=state)


def rescaled_position(first: dict, world_size: int):
    """(extra_state with the train iterator's count of per-rank batches for world_size ranks, batches seen again)"""
    extra = copy.deepcopy(first.get("extra_state"))
    iterator = (extra or {}).get("train_iterator")
    old_world = (first["cfg"].get("distributed_training") or {}).get("distributed_world_size") or 1
    if not iterator or "iterations_in_epoch" not in iterator:
        return extra, 0
    consumed = iterator["iterations_in_epoch"] * old_world       # global batches of this epoch done
    iterator["iterations_in_epoch"] = consumed // world_size
    return extra, consumed % world_size


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


def consolidate(rank0_path: str, out_path: str, overwrite: bool = False, weights_only: bool = False,
                world_size: int = 1) -> int:
    """Write the merged checkpoint (for a run at --moe-ep-size 1 on world_size processes); returns the ep_size
    merged over."""
    return _reshard(rank0_path, [out_path], 1, world_size, overwrite, weights_only)[0]


def reshard(rank0_path: str, out_dir: str, new_ep_size: int, world_size: Optional[int] = None,
            overwrite: bool = False, weights_only: bool = False) -> List[str]:
    """Write the per-rank checkpoints of a run with --moe-ep-size new_ep_size on world_size processes (one file when
    new_ep_size is 1)."""
    paths = destinations(rank0_path, out_dir, new_ep_size, world_size)
    _reshard(rank0_path, paths, new_ep_size, world_size or new_ep_size, overwrite, weights_only)
    return paths


def destinations(rank0_path: str, out_dir: str, new_ep_size: int, world_size: Optional[int] = None) -> List[str]:
    """OUT_DIR/<name>-rank-<R>.pt for each of world_size ranks (default new_ep_size), or OUT_DIR/<name>.pt at
    --ep-size 1 (every rank loads that one file)."""
    world_size = world_size or new_ep_size
    name = os.path.basename(rank_paths(rank0_path, 1)[0])[:-len("-rank-0.pt")]
    suffixes = [f"-rank-{rank}" for rank in range(world_size)] if new_ep_size > 1 else [""]
    return [os.path.join(out_dir, f"{name}{suffix}.pt") for suffix in suffixes]


def _reshard(rank0_path, paths, new_ep_size, world_size, overwrite, weights_only):
    """(ep_size merged over, batches the resumed run sees again)"""
    rank_paths(rank0_path, 1)
    check_destinations(rank0_path, paths, overwrite)
    if new_ep_size < 1:
        raise ValueError(f"--ep-size {new_ep_size} is invalid: must be at least 1")
    if world_size < 1 or world_size % new_ep_size:
        raise ValueError(f"--world-size {world_size} is invalid: must be a multiple of --ep-size {new_ep_size}")
    first, model, optimizer, keys, ep_size = merged(rank0_path, weights_only)
    num_experts = first["cfg"]["model"].moe_expert_count
    if num_experts % new_ep_size:
        raise ValueError(f"--ep-size {new_ep_size} is invalid: must divide --moe-expert-count {num_experts} "
                         f"(ep sizes above the expert count slice experts, which resharding does not do)")
    extra, again = rescaled_position(first, world_size)
    os.makedirs(os.path.dirname(os.path.abspath(paths[0])), exist_ok=True)
    for rank, path in enumerate(paths):
        block = rank % new_ep_size      # ranks R >= new_ep_size hold copies of block R % new_ep_size
        local = {key: value.chunk(new_ep_size, dim=0)[block].clone() if key.endswith(EXPERT_TENSORS) else value
                 for key, value in model.items()} if new_ep_size > 1 else model
        local_state = None if optimizer is None else \
            local_optimizer(optimizer, keys, new_ep_size, block) if new_ep_size > 1 else optimizer
        suffix = f"-rank-{rank}" if new_ep_size > 1 else ""
        _write(first, local, local_state, extra, new_ep_size, world_size, suffix, path)
    return ep_size, again


def _write(first: dict, model: dict, optimizer: Optional[dict], extra: Optional[dict], ep_size: int,
           world_size: int, suffix: str, path: str) -> None:
    """first with this model, optimizer state, extra_state and layout, written atomically (a temporary file beside
    it, renamed into place)."""
    state = dict(first, model=model, extra_state=extra)
    state["cfg"] = copy.deepcopy(first["cfg"])
    state["cfg"]["model"].moe_ep_size = ep_size
    state["cfg"]["model"].base_layers = 1 if ep_size > 1 else 0   # fairseq's switch for per-rank checkpoints
    state["cfg"]["checkpoint"]["checkpoint_suffix"] = suffix
    if isinstance(state["cfg"].get("distributed_training"), dict):
        state["cfg"]["distributed_training"]["distributed_world_size"] = world_size
    if optimizer is None:
        state.pop("last_optimizer_state", None)
    else:
        state["last_optimizer_state"] = optimizer
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
    parser.add_argument("--weights-only", action="store_true", help="leave the optimizer state out (fairseq-train "
                        "then restarts the optimizer, LR schedule and update count); needed for any optimizer "
                        "state but fp32 Adam's")
    parser.add_argument("--overwrite", action="store_true", help="replace destination files that exist (never the "
                                                                 "source run's own checkpoints)")
    args = parser.parse_args(argv)
    carried = "the weights" if args.weights_only else "the weights and optimizer state"
    try:
        merge = args.ep_size == 1 and args.world_size in (None, 1)
        paths = [args.out] if merge else destinations(args.rank0_checkpoint, args.out, args.ep_size, args.world_size)
        ep_size, again = _reshard(args.rank0_checkpoint, paths, args.ep_size, args.world_size or args.ep_size,
                                  args.overwrite, args.weights_only)
        if merge:
            print(f"merged the experts of {ep_size} ranks into {args.out} ({carried})")
        else:
            print(f"resharded the experts to --moe-ep-size {args.ep_size} on {args.world_size or args.ep_size} "
                  f"processes: {len(paths)} checkpoint(s) in {args.out} ({carried})")
        if again:
            print(f"note: the run's position in its epoch is not a whole number of batches per rank at "
                  f"--world-size {args.world_size}: the resumed run sees its last {again} batches again")
    except ValueError as error:
        print(f"consolidate: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
