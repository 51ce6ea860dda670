"""Expert-sharded checkpoints with torch.distributed.checkpoint (DCP): no gather, any layout on load.

Shape legend: moe_plugin/__init__.py (here E experts, D model dim, H expert hidden dim, F = 2H for a gated
activation (swiglu, geglu, ...: w1 holds [gate | up]) else H; `slices` hidden slices per expert when
ep_size > num_experts).

The expert tensors of every expert-parallel MoELayer (experts.w1_EDH [E, D, F], b1_EH [E, F],
w2_EHD [E, H, D], b2_ED [E, D]) are described to DCP as this rank's pieces of the logical full
tensors: a rank holding whole experts has one piece, a rank holding hidden slice s of a gated
expert has two (its gate and up columns), and only slice 0 writes the expert's b2 (the other slices
never train theirs). Each process writes its own pieces and DCP reshards on load into whatever
pieces the loading layout asks for. Every other tensor is replicated: DCP writes one copy.

A checkpoint is a flat dict: "model.<name>" for model.state_dict(), "optimizer.<name>.<key>" for
AdamW-style per-parameter state, and any other objects the caller adds. Its logical tensors are
those of one process holding the whole model, so full_state()/write_sharded() turn it into one
file and back.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .experts import WEIGHT_NAMES as EXPERT_NAMES   # the stacked experts' tensors
from .parallel.expert_grads import expert_layers

Offsets = Tuple[int, ...]
W2, B2 = EXPERT_NAMES[2:]     # the second projection: its weight sliced along H, its bias whole (slice 0 writes it)


class ExpertPieces:
    """This rank's pieces (views of its tensor) of one logical tensor of size global_size."""

    def __init__(self, global_size: torch.Size, pieces: List[Tuple[Offsets, torch.Tensor]]):
        self.global_size, self.pieces = torch.Size(global_size), pieces

    def size(self) -> torch.Size:
        return self.global_size

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces]

    def __create_write_items__(self, fqn: str, _):
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                           TensorProperties)
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o), i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape),
                              properties=TensorProperties.create_from_tensor(t), size=self.global_size))
                for i, (o, t) in enumerate(self.pieces)]

    def piece(self, offsets) -> torch.Tensor:
        for o, t in self.pieces:
            if tuple(o) == tuple(offsets):
                return t
        raise KeyError(f"no piece at offsets {tuple(offsets)}")


def expert_pieces(layer: nn.Module, name: str, tensor: torch.Tensor, writing: bool) -> ExpertPieces:
    """The pieces of one expert tensor (a parameter or a same-shaped optimizer state) of `layer`.

    Under FSDP2 (a DTensor) this rank holds only a shard of its expert stack: the pieces are the shard's.
    writing: leave out what this rank must not write (b2 of hidden slices other than 0)."""
    full = list(tensor.shape)               # a DTensor's shape is the rank's whole stack
    tensor, at = _local_shard(tensor)
    layout = layer.groups.layout
    E, slices, s, first = layout.num_experts, layout.slices, layout.slice_index, layout.first_expert
    lead = (first + at[0],) + tuple(at[1:-1])       # offsets in the expert dim and the middle dims
    if slices == 1:
        return _pieces([E] + full[1:], [((first + at[0],) + tuple(at[1:]), tensor)])
    h = layout.local_hidden   # E_local is 1 here
    if name == W2:
        return _pieces([E, h * slices] + full[2:], [((first + at[0], s * h + at[1], at[2]), tensor)])
    if name == B2:
        return _pieces([E] + full[1:], [] if writing and s else [((first + at[0], at[1]), tensor)])
    halves = full[-1] // h                        # w1 and b1: F / H halves of h columns each
    start, end, pieces = at[-1], at[-1] + tensor.shape[-1], []   # the columns of the stack held here
    for a in range(halves):
        lo, hi = max(start, a * h), min(end, (a + 1) * h)
        if lo < hi:
            pieces.append((lead + (a * h * slices + s * h + lo - a * h,), tensor[..., lo - start:hi - start]))
    return _pieces([E] + full[1:-1] + [halves * h * slices], pieces)


def _pieces(size, pieces) -> ExpertPieces:
    return ExpertPieces(size, [(o, t) for o, t in pieces if t.numel()])   # an FSDP2 shard may be empty


def _local_shard(tensor: torch.Tensor) -> Tuple[torch.Tensor, Offsets]:
    """(the part this rank holds, its offsets in the rank's whole tensor): a DTensor's local shard, or tensor."""
    from torch.distributed.tensor import DTensor
    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(offsets)


def expert_tensor_names(model: nn.Module) -> Dict[str, Tuple[nn.Module, str]]:
    """name in model.state_dict() -> (its expert-parallel layer, its name in layer.experts); a LoRA adapter's
    factors (moe_plugin.lora: [E, ...], whole experts only) are expert tensors too."""
    names = {}
    for prefix, layer in expert_layers(model):
        lora = getattr(layer.experts, "lora", None)
        adapter = [f"lora.{n}" for n, _ in lora.named_parameters()] if isinstance(lora, nn.Module) else []
        for name in [n for n in EXPERT_NAMES if getattr(layer.experts, n) is not None] + adapter:
            names[f"{prefix}experts.{name}"] = (layer, name)
    return names


def _entries(tensors: List[Tuple[str, str, torch.Tensor]], writing: bool,
             experts: Dict[str, Tuple[nn.Module, str]]) -> Dict[str, Any]:
    """(checkpoint key, name of the tensor in the model it belongs to, tensor) -> checkpoint entries."""
    out = {}
    for key, owner, tensor in tensors:
        if owner not in experts:
            out[key] = tensor
            continue
        layer, name = experts[owner]
        if tensor.dim() == 0:    # AdamW's step: replicated, but only from the ranks that write the tensor
            if not writing or expert_pieces(layer, name, layer.experts.get_parameter(name), True).pieces:
                out[key] = tensor
            continue
        pieces = expert_pieces(layer, name, tensor, writing)
        if pieces.pieces or not writing:   # reading none (an empty FSDP2 shard) still reads the key
            out[key] = pieces
    return out


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without state the state AdamW would create at its first step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer = None, writing: bool = True) -> Dict[str, Any]:
    """The flat DCP state dict of model (and optimizer: AdamW-style per-parameter state, keyed by name).

    writing=True for saving: what this rank writes; False for loading: what this rank needs."""
    experts = expert_tensor_names(model)
    state = _entries([(f"model.{k}", k, v.detach()) for k, v in model.state_dict(keep_vars=True).items()],
                     writing, experts)
    if optimizer is not None:
        ensure_optimizer_state(optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        state.update(_entries([(f"optimizer.{names[id(p)]}.{k}", names[id(p)], v)
                               for group in optimizer.param_groups for p in group["params"]
                               for k, v in optimizer.state[p].items()], writing, experts))
    return state


def _planners():
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = self.state_dict[index.fqn]
            return obj.piece(index.offset) if isinstance(obj, ExpertPieces) else super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            pieces = {k: v for k, v in state_dict.items() if isinstance(v, ExpertPieces)}
            super().set_up_planner(state_dict, metadata, is_coordinator)  # it sets objects it does not know to None
            state_dict.update(pieces)
            self.state_dict.update(pieces)

        def lookup_tensor(self, index):
            obj = self.state_dict[index.fqn]
            return obj.piece(index.offset) if isinstance(obj, ExpertPieces) else super().lookup_tensor(index)

    return SavePlanner, LoadPlanner


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet():
    """DCP warns that it assumes one process whenever torch.distributed is not initialized: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(state: Dict[str, Any], path: Path) -> None:
    """Every rank writes its pieces and its share of the replicated tensors into the folder path (a collective)."""
    import torch.distributed.checkpoint as dcp
    SavePlanner, _ = _planners()
    with _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), planner=SavePlanner(), no_dist=_no_dist())


def load(state: Dict[str, Any], path: Path) -> None:
    """Fill state's tensors and pieces in place (and its objects) from the checkpoint folder path (a collective)."""
    import torch.distributed.checkpoint as dcp
    _, LoadPlanner = _planners()
    check_sizes(state, metadata(path), path)
    with _quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), planner=LoadPlanner(), no_dist=_no_dist())


def metadata(path: Path):
    import torch.distributed.checkpoint as dcp
    if not (Path(path) / ".metadata").is_file():
        raise ValueError(f"{str(path)!r} is not a sharded checkpoint: it has no .metadata file")
    return dcp.FileSystemReader(str(path)).read_metadata()


def check_sizes(state: Dict[str, Any], meta, path: Path) -> None:
    """ValueError naming the first tensors the checkpoint lacks, holds in another size, or holds beyond the model."""
    saved = meta.state_dict_metadata
    missing = [k for k in state if k not in saved]
    wrong = [f"{k} {tuple(saved[k].size)} (this run: {tuple(v.size())})" for k, v in state.items()
             if k in saved and hasattr(saved[k], "size") and hasattr(v, "size") and saved[k].size != v.size()]
    extra = [k for k in saved if k.startswith(("model.", "optimizer.")) and k not in state]

    def some(keys):
        return ", ".join(keys[:4]) + (" ..." if len(keys) > 4 else "")
    problems = ([f"it lacks {some(missing)}"] if missing else []) + ([f"it holds {some(wrong)}"] if wrong else []) + \
               ([f"it holds {some(extra)}, which this model does not have"] if extra else [])
    if problems:
        raise ValueError(f"checkpoint {str(path)!r} does not fit this model: {'; '.join(problems)} "
                         f"(it was written for another model or moe config)")


def full_state(path: Path) -> Dict[str, Any]:
    """Every tensor of a sharded checkpoint, whole, and its objects, read by this one process."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    meta = metadata(path)
    state = {}
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[key] = None
        else:
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    import torch.distributed.checkpoint as dcp
    with _quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return state


def write_sharded(state: Dict[str, Any], path: Path) -> None:
    """Write a flat dict of whole tensors and objects as a sharded checkpoint by this one process."""
    import torch.distributed.checkpoint as dcp
    with _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def nest(flat: Dict[str, Any]) -> Dict[str, Any]:
    """{"model.a.b": t, "optimizer.a.b.exp_avg": t, "x": o} -> {"model": {"a.b": t}, "optimizer": {"a.b": {"exp_avg": t}}, "x": o}."""
    out: Dict[str, Any] = {"model": {}, "optimizer": {}}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        if section == "model" and rest:
            out["model"][rest] = value
        elif section == "optimizer" and rest:
            name, _, state_key = rest.rpartition(".")
            out["optimizer"].setdefault(name, {})[state_key] = value
        else:
            out[key] = value
    return out


def flatten(nested: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of nest()."""
    flat = {f"model.{k}": v for k, v in nested.get("model", {}).items()}
    flat.update({f"optimizer.{name}.{k}": v for name, state in nested.get("optimizer", {}).items()
                 for k, v in state.items()})
    flat.update({k: v for k, v in nested.items() if k not in ("model", "optimizer")})
    return flat


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def replace_folder(tmp: Path, final: Path) -> None:
    """Move the finished folder tmp to final; a folder already at final goes only once tmp is in place."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        import shutil
        shutil.rmtree(old)
