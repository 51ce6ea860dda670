"""`moe-plugin checkpoint inspect|convert`: look into a checkpoint of `moe-plugin train`, or turn it
into one full state-dict file (for evaluation and export) and back.

The full file is one torch.save dict, loadable with torch.load(weights_only=True):

    model                    model.state_dict() as one process holding every expert has it
    optimizer                {parameter name: {step, exp_avg, exp_avg_sq}}, whole tensors
    optimizer_param_groups   the optimizer's hyperparameters
    scheduler                the LR schedule's state_dict()
    ranks                    {rank: its data position, RNG states and metrics window}
    meta                     the step, the layout that wrote it and the config
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict

import torch

from .. import checkpoint as sharded
from ..routing_monitor import report as routing_report
from ..tutel import checkpoints as tutel_checkpoints
from . import manifest
from .checkpoint import pack, read_meta, unpack, verify

FULL_FORMAT = "moe_plugin full checkpoint v1"


def to_full(folder: Path) -> Dict[str, Any]:
    problem = verify(folder)
    if problem is not None:
        raise ValueError(f"{str(folder)!r} is damaged: {problem}")
    read_meta(folder)
    nested = sharded.nest(sharded.full_state(folder))
    ranks = {int(key.split(".", 1)[1]): unpack(nested.pop(key)) for key in list(nested) if key.startswith("rank.")}
    return {"format": FULL_FORMAT, "model": nested["model"], "optimizer": nested["optimizer"],
            "optimizer_param_groups": unpack(nested["optimizer_param_groups"]),
            "scheduler": unpack(nested["scheduler"]), "ranks": ranks, "meta": json.loads(nested["meta"])}


def check_target(source: Path, target: Path, overwrite: bool) -> None:
    """ValueError unless convert may write target: nothing there (or, with overwrite, a file where a file is
    written, a checkpoint folder where a folder is), and never the source itself, a place inside it or a folder
    that holds it."""
    src, dst = source.resolve(), target.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        where = "is" if dst == src else "is inside" if src in dst.parents else "holds"
        raise ValueError(f"{str(target)!r} {where} the source {str(source)!r}: convert never writes over its own "
                         f"source (--overwrite included); give another target")
    if not target.exists() and not target.is_symlink():
        return
    kind = "folder" if target.is_dir() else "file"
    if not overwrite:
        raise ValueError(f"{str(target)!r} exists (a {kind}): convert does not replace it unless asked; add "
                         f"--overwrite to replace it, or give another target")
    writes = "file" if source.is_dir() else "folder"
    if kind != writes:
        raise ValueError(f"{str(target)!r} is a {kind}, and convert writes a {writes} there: --overwrite replaces a "
                         f"{writes} only; remove it yourself or give another target")
    if kind == "folder" and any(target.iterdir()) and not (target / "meta.json").is_file():
        raise ValueError(f"{str(target)!r} is a folder that is not a checkpoint of `moe-plugin train` (no meta.json): "
                         f"--overwrite replaces a checkpoint folder only; give another target")


def write_full(folder: Path, file: Path) -> None:
    """The sharded checkpoint folder as one full state-dict file, written atomically (a temporary file in the same
    folder, renamed over the target only once whole)."""
    full = to_full(folder)
    file.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            torch.save(full, out)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)    # as open() would make it, not mkstemp's 0600
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_full(file: Path) -> Dict[str, Any]:
    try:
        full = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise ValueError(f"{str(file)!r} is not a full checkpoint file: torch.load fails ({str(error).splitlines()[0]})")
    if not isinstance(full, dict) or full.get("format") != FULL_FORMAT:
        found = full.get("format") if isinstance(full, dict) else type(full).__name__
        raise ValueError(f"{str(file)!r} is not a full checkpoint file written by `moe-plugin checkpoint convert` "
                         f"(format {found!r}, expected {FULL_FORMAT!r})")
    return full


def write_folder(file: Path, folder: Path) -> None:
    """A full state-dict file as a sharded checkpoint folder (written as folder.tmp, then renamed)."""
    full = read_full(file)
    state = sharded.flatten({"model": full["model"], "optimizer": full["optimizer"]})
    state.update({"meta": json.dumps(full["meta"]), "scheduler": pack(full["scheduler"]),
                  "optimizer_param_groups": pack(full["optimizer_param_groups"])})
    state.update({f"rank.{rank}": pack(value) for rank, value in full["ranks"].items()})
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sharded.write_sharded(state, tmp)
    (tmp / "meta.json").write_text(json.dumps(full["meta"], indent=1) + "\n")
    manifest.write(tmp)
    sharded.replace_folder(tmp, folder)


def describe(path: Path) -> str:
    """The step, the layout that wrote it, the size and the experts' pieces of a checkpoint folder or full file.
    ValueError naming the file when a folder is damaged (its manifest.json's sizes and checksums)."""
    if path.is_file():
        full = read_full(path)
        meta = full["meta"]
        count = sum(t.numel() for t in full["model"].values())
        return (f"full checkpoint file {path}\n{_header(meta)}\n"
                f"size: {path.stat().st_size / 1e6:.2f} MB; {len(full['model'])} model tensors, "
                f"{count:,} model values\n")
    problem = verify(path)
    if problem is not None:
        raise ValueError(f"DAMAGED checkpoint {path}: {problem}")
    meta = read_meta(path)
    md = sharded.metadata(path).state_dict_metadata
    tensors = {k: v for k, v in md.items() if hasattr(v, "chunks")}
    model = {k: v for k, v in tensors.items() if k.startswith("model.")}
    count = sum(torch.Size(v.size).numel() for v in model.values())
    lines = [f"sharded checkpoint {path}", _header(meta),
             f"size: {sharded.folder_bytes(path) / 1e6:.2f} MB in {len(list(path.iterdir()))} files; "
             f"{len(model)} model tensors, {count:,} model values; "
             f"{len(tensors) - len(model)} optimizer tensors",
             "manifest: every file's size and every CRC-32 match",
             "experts (logical size: pieces as written):"]
    for key, value in model.items():
        if key.rsplit(".", 1)[-1] in sharded.EXPERT_NAMES:
            pieces = ", ".join(f"{list(c.sizes)} at {list(c.offsets)}" for c in value.chunks)
            lines.append(f"  {key[len('model.'):]} {list(value.size)}: {pieces}")
    return "\n".join(lines) + "\n"


def _header(meta: dict) -> str:
    processes = meta["world_size"]
    return (f"step {meta['step']}, written by {processes} process{'es' if processes > 1 else ''} "
            f"with parallel.ep_size={meta['ep_size']}")


def add_arguments(parser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser("inspect", help="print the step, the layout that wrote it and the size, "
                                 "after checking every file against the manifest (exit status 2 if damaged)")
    inspect.add_argument("path", help="a checkpoint folder (checkpoints/step_NNNNNN) or a full checkpoint file")
    convert = actions.add_parser("convert", help="a checkpoint folder -> one full state-dict file, or back; or "
                                 "(--from tutel) Tutel's and Swin-MoE's per-rank files -> files for any number of ranks")
    convert.add_argument("source", nargs="+", help="a checkpoint folder, or a full checkpoint file; with --from tutel "
                         "every rank's file of one run ({rank}-of-{size} names, or Swin-MoE's NAME.pth.rank{rank} and "
                         "NAME.pth.master)")
    convert.add_argument("target", help="the full checkpoint file, or the checkpoint folder, to write; with --from "
                         "tutel a file pattern with {rank} and {size} (one file when --ranks 1)")
    convert.add_argument("--overwrite", action="store_true", help="replace the target if it exists (a file, or a "
                         "checkpoint folder); never the source itself")
    tutel = convert.add_argument_group("Tutel and Swin-MoE checkpoints (docs/tutel.md)")
    tutel.add_argument("--from", dest="from_format", choices=["tutel"], help="the sources are Tutel's per-rank files")
    tutel.add_argument("--ranks", type=int, help="write one Tutel file per rank of a run of RANKS ranks")
    tutel.add_argument("--to", choices=["tutel", "moe_plugin"], default=None,
                       help="tutel (default): Tutel's layout; moe_plugin: one state dict with MoELayer's names")
    tutel.add_argument("--namespace", help="the entry the files keep the model's state dict under (default: the file "
                       "itself, or its 'model' entry as Swin-MoE's)")
    tutel.add_argument("--num-experts", type=int, help="the experts of layers whose files tell neither by "
                       "_num_global_experts nor by a gate")
    tutel.add_argument("--gate", type=int, help="with --to moe_plugin: the gate (gates.N) that becomes the router")
    routing_report.add_arguments(actions.add_parser("routing", help="run a checkpoint over sample data: each MoE "
                                                    "layer's load, co-selection and topics (pictures, text, HTML)"))


def main(args) -> int:
    if args.action == "routing":
        return routing_report.main(args)
    try:
        if args.action == "convert" and (args.from_format or len(args.source) > 1 or _tutel_options(args)):
            return _convert_tutel(args)
        source = Path(args.path if args.action == "inspect" else args.source[0])
        if not source.exists():
            raise ValueError(f"{str(source)!r} does not exist")
        if args.action == "inspect":
            print(describe(source), end="")
        elif source.is_dir():
            check_target(source, Path(args.target), args.overwrite)
            write_full(source, Path(args.target))
            print(f"wrote {args.target}: every tensor of {source} whole, in one file")
        else:
            check_target(source, Path(args.target), args.overwrite)
            write_folder(source, Path(args.target))
            print(f"wrote {args.target}: a sharded checkpoint that resumes on any number of processes and ep_size")
    except ValueError as error:
        print(f"moe-plugin checkpoint: {error}", file=sys.stderr)
        return 2
    return 0


def _tutel_options(args) -> list:
    return [f"--{name.replace('_', '-')}" for name in ("ranks", "to", "namespace", "num_experts", "gate")
            if getattr(args, name) is not None]


def _convert_tutel(args) -> int:
    if args.from_format != "tutel":
        given = _tutel_options(args) or [f"{len(args.source)} sources"]
        raise ValueError(f"{', '.join(given)} given without --from tutel: they are for Tutel's per-rank files")
    missing = [path for path in args.source if not Path(path).exists()]
    if missing:
        raise ValueError(f"{missing[0]!r} does not exist")
    print(tutel_checkpoints.convert([Path(p) for p in args.source], args.target, args.ranks, args.to or "tutel",
                                    args.namespace, args.num_experts, args.gate, args.overwrite))
    return 0
