"""DeepSpeed's zero_to_fp32 for MoE checkpoints: ZeRO-3 with experts split over expert-data-parallel groups, ZeRO-1/2.

At ep_size > 1 under ZeRO-3 (zero3.py) each expert parameter holds the experts of one expert-parallel rank and is
split over that rank's expert-data-parallel group; dense parameters are split over all ranks. DeepSpeed's
consolidation assumes the latter for every parameter and stops ("consumed N numels out of M"). The checkpoint does
record, per optimizer sub-group, the ranks it was split over (ds_zero_partition_groups), so here each sub-group is
merged over its own ranks and each layer's expert tensors are put together from its expert-parallel ranks with the
layer's ExpertLayout (hidden slices included). Names are the model's parameter names, as DeepSpeed's are; the
result loads into the same model built in one process (ep_size 1).

ZeRO-1/2 checkpoints of DeepSpeed MoE layers (per-expert layer_<L>_expert_<E>_... files beside the dp-rank-0 model
file), which DeepSpeed's consolidation cannot read at any ep_size, go through zero12_moe_state_dict: each optimizer
group merged over the ranks it was split over (an expert group over its expert-data-parallel group), experts put
together as above.

enable() (hook.py) makes DeepSpeed's get_fp32_state_dict_from_zero_checkpoint, convert_zero_checkpoint_to_*,
and load_state_dict_from_zero_checkpoint use these; every other checkpoint (dense models, AutoEP's) goes to
DeepSpeed unchanged. Files are picked by DeepSpeed's exact names (bf16_ prefix included), never by a loose glob.
The zero_to_fp32.py that DeepSpeed copies next to a checkpoint is DeepSpeed's own; main() (run by
`python -m moe_plugin.integrations.deepspeed.zero_to_fp32`) takes its arguments instead.
"""
import argparse
import math
import os
import re
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch

from moe_plugin.checkpoint import expert_pieces
from moe_plugin.parallel.groups import ExpertLayout

__all__ = ["expert_partitioned_state_dict", "zero12_moe_state_dict", "patch_zero_to_fp32", "unpatch_zero_to_fp32", "main"]

EXPERT_FAMILY = "autoep_expert"        # zero3.EXPERT_FAMILY (not imported: this module must not need deepspeed)
_ORIGINAL = "_moe_plugin_original"
# one module per local expert: moe_plugin's general path (experts.local.<i>), DeepSpeed's native layer (ZeRO 1/2)
_LOCAL_EXPERT = re.compile(r"^(?P<layer>.*)experts\.(?P<list>local|deepspeed_experts)\.(?P<index>\d+)\.(?P<rest>.+)$")


# DeepSpeed 0.19.8's file names in a tag folder (engine._get_ckpt_name, _get_zero_ckpt_name, _get_expert_ckpt_name)
_ZERO_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")   # ZeRO 1-3, per dp rank
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")           # ZeRO-3, per dp rank
_EXPERT_MODEL = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")   # ZeRO 0-2 MoE
_MODEL_12 = "mp_rank_00_model_states.pt"                                                   # ZeRO 0-2, dp rank 0


def _files(ds_checkpoint_dir: str, pattern: "re.Pattern") -> List[str]:
    """The files of the tag folder whose names match pattern, by data-parallel rank (tensor-parallel rank 0 only;
    _tensor_parallel tells whether there are others)."""
    found = []
    for name in os.listdir(ds_checkpoint_dir) if os.path.isdir(ds_checkpoint_dir) else ():
        match = pattern.match(name)
        if match and int(match.group(2)) == 0:
            found.append((int(match.group(1)), os.path.join(ds_checkpoint_dir, name)))
    return [path for _, path in sorted(found)]


def _tensor_parallel(ds_checkpoint_dir: str) -> bool:
    return any((_ZERO_OPTIM.match(n) or _ZERO3_MODEL.match(n)) and not n.split("_mp_rank_")[1].startswith("00_")
               for n in os.listdir(ds_checkpoint_dir))


def _partition_groups(optim_file: str) -> Optional[list]:
    state = torch.load(optim_file, map_location="cpu", mmap=True, weights_only=False)
    return state["optimizer_state_dict"].get("ds_zero_partition_groups")


def _is_expert_partitioned(ds_checkpoint_dir: str) -> bool:
    """A ZeRO-3 checkpoint of moe_plugin's layers with a sub-group split over fewer than all ranks."""
    optim_files = _files(ds_checkpoint_dir, _ZERO_OPTIM)
    model_files = _files(ds_checkpoint_dir, _ZERO3_MODEL)
    if not optim_files or not model_files or _tensor_parallel(ds_checkpoint_dir):
        return False
    groups = _partition_groups(optim_files[0]) or []
    split = any(EXPERT_FAMILY in g.get("families", ()) and g["partition_count"] < len(optim_files) for g in groups)
    if not split:
        return False
    model_state = torch.load(model_files[0], map_location="cpu", weights_only=False)
    return "ds_autoep_layers" not in model_state   # DeepSpeed's AutoEP: DeepSpeed's own conversion answers


def _is_zero12_moe(ds_checkpoint_dir: str) -> bool:
    """A ZeRO-1/2 checkpoint of DeepSpeed MoE layers (per-expert model files beside the dp-rank-0 model file).
    DeepSpeed's own consolidation reads an expert file as the model file there and stops ("... is not a model state
    checkpoint"), whatever the ep_size."""
    if not os.path.isdir(ds_checkpoint_dir) or _tensor_parallel(ds_checkpoint_dir):
        return False
    names = os.listdir(ds_checkpoint_dir)
    return (_MODEL_12 in names and any(_EXPERT_MODEL.match(n) for n in names)
            and bool(_files(ds_checkpoint_dir, _ZERO_OPTIM)))


def expert_partitioned_state_dict(ds_checkpoint_dir: str, exclude_frozen_parameters: bool = False
                                  ) -> Dict[str, torch.Tensor]:
    """The fp32 state dict of a ZeRO-3 checkpoint (the tag folder) with experts split over expert-data groups."""
    model_files = _files(ds_checkpoint_dir, _ZERO3_MODEL)
    optim_files = _files(ds_checkpoint_dir, _ZERO_OPTIM)
    world = len(optim_files)
    if len(model_files) != world:
        raise ValueError(f"{ds_checkpoint_dir} has {len(model_files)} model-state files and {world} optimizer-state "
                         f"files; a ZeRO-3 checkpoint has one of each per data-parallel rank")
    models = [torch.load(f, map_location="cpu", weights_only=False) for f in model_files]
    dims = models[0].get("checkpoint_parallel_dimensions", {})
    if dims.get("pp_degree", 1) != 1 or dims.get("tp_degree", 1) != 1 or models[0].get("mp_world_size", 1) != 1:
        raise ValueError(f"consolidating expert-partitioned ZeRO-3 checkpoints supports data and expert parallelism "
                         f"only; this one has {dims} (mp_world_size {models[0].get('mp_world_size')})")
    optims = [torch.load(f, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
              for f in optim_files]
    flat_groups = [o["fp32_flat_groups"] for o in optims]
    metas = [o["ds_zero_partition_groups"] for o in optims]
    state = {name: tensor.float() if tensor.is_floating_point() else tensor
             for name, tensor in models[0]["module"].items() if name in models[0]["buffer_names"]}
    shapes = {name: shape for group in models[0]["param_shapes"] for name, shape in group.items()}

    local_experts: Dict[str, Dict[int, torch.Tensor]] = {}   # name -> {ep_rank: this ep rank's tensor}
    for g, meta in enumerate(metas[0]):
        members_of = {tuple(m[g]["partition_ranks"]) for m in metas}
        for members in sorted(members_of):
            for name, tensor in _merge_sub_group(g, list(members), metas, flat_groups, models).items():
                if EXPERT_FAMILY not in meta.get("families", ()) or len(members) == world:
                    state[name] = tensor
                else:
                    ep_size = _ep_size(meta, name)
                    local_experts.setdefault(name, {})[_ep_rank(members[0], members, world, ep_size)] = tensor
    for name, by_rank in local_experts.items():
        state.update(_whole_experts(name, by_rank, shapes))
    if not exclude_frozen_parameters:
        state.update(_frozen(models, local_experts))
    for alias, name in models[0].get("shared_params", {}).items():
        if name in state:
            state[alias] = state[name]
    return state


def zero12_moe_state_dict(ds_checkpoint_dir: str, exclude_frozen_parameters: bool = False
                          ) -> Dict[str, torch.Tensor]:
    """The fp32 state dict of a ZeRO-1/2 checkpoint (the tag folder) of DeepSpeed MoE layers, every expert whole.

    Each optimizer group's flat fp32 partitions are merged over the ranks it was split over: all ranks for a dense
    group, each expert-data-parallel group for an expert group (partition_count = world / ep_size). Expert tensors
    are then put together over the expert-parallel ranks as at ZeRO-3 (the names are rank 0's, which every
    expert-parallel rank shares)."""
    optim_files = _files(ds_checkpoint_dir, _ZERO_OPTIM)
    model = torch.load(os.path.join(ds_checkpoint_dir, _MODEL_12), map_location="cpu", weights_only=False)
    dims = model.get("checkpoint_parallel_dimensions", {})
    if dims.get("pp_degree", 1) != 1 or model.get("mp_world_size", 1) != 1:
        raise ValueError(f"consolidating ZeRO-1/2 MoE checkpoints supports data and expert parallelism only; this "
                         f"one has {dims} (mp_world_size {model.get('mp_world_size')})")
    optims = [torch.load(f, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
              for f in optim_files]
    world = len(optims)
    counts = optims[0]["partition_count"]
    counts = counts if isinstance(counts, list) else [counts] * len(model["param_shapes"])
    if max(counts) != world:
        raise ValueError(f"{ds_checkpoint_dir} has {world} optimizer-state files, but its dense groups were split "
                         f"over {max(counts)} ranks: a file is missing or left from another run")
    paddings = optims[0].get("param_alignment_paddings") or [None] * len(counts)
    state = {name: tensor.float() if tensor.is_floating_point() else tensor
             for name, tensor in model["module"].items() if name in model["buffer_names"]}
    shapes = {name: shape for group in model["param_shapes"] for name, shape in group.items()}
    local_experts: Dict[str, Dict[int, torch.Tensor]] = {}   # name -> {ep_rank: this ep rank's tensor}
    for g, (group_shapes, count) in enumerate(zip(model["param_shapes"], counts)):
        if world % count:
            raise ValueError(f"optimizer group {g} was split over {count} ranks, which does not divide {world}")
        ep_size = world // count
        if ep_size == 1:
            state.update(_merge_flat(g, list(range(world)), optims, group_shapes, paddings[g]))
            continue
        from deepspeed.utils.groups import _get_expert_parallel_ranks
        for members in _get_expert_parallel_ranks(world, 1, ep_size)[1]:
            ep_rank = _ep_rank(members[0], members, world, ep_size)
            for name, tensor in _merge_flat(g, sorted(members), optims, group_shapes, paddings[g]).items():
                local_experts.setdefault(name, {})[ep_rank] = tensor
    for name, by_rank in local_experts.items():
        state.update(_whole_experts(name, by_rank, shapes))
    if not exclude_frozen_parameters:
        layers = {_layer_prefix(name) for name in local_experts}
        for name in (model.get("frozen_param_shapes") or {}):
            if any(name.startswith(layer) for layer in layers):
                raise ValueError(f"frozen expert parameter {name!r}: a ZeRO-1/2 checkpoint keeps only rank 0's "
                                 f"frozen parameters, so it cannot be consolidated at ep_size > 1; pass "
                                 f"exclude_frozen_parameters=True, or train it")
            state[name] = model["frozen_param_fragments"][name]
    for alias, name in model.get("shared_params", {}).items():
        if name in state:
            state[alias] = state[name]
    return state


def _merge_flat(g: int, members: List[int], optims, shapes, paddings) -> Dict[str, torch.Tensor]:
    """ZeRO-1/2 group g's parameters from the fp32 partitions of members (in partition order)."""
    flat = torch.cat([optims[r]["single_partition_of_fp32_groups"][g] for r in members])
    merged, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise ValueError(f"optimizer group {g} of ranks {members} holds {flat.numel()} elements, too few for "
                             f"its parameters; it was not written by this layout")
        merged[name] = flat[offset:offset + numel].view(tuple(shape)).clone()
        offset += numel + (paddings[i] if paddings else 0)
    return merged


def _merge_sub_group(g: int, members: List[int], metas, flat_groups, models) -> Dict[str, torch.Tensor]:
    """Sub-group g's parameters, put together from the flat fp32 partitions of the ranks it was split over."""
    members = sorted(members, key=lambda r: metas[r][g]["partition_rank"])
    count = metas[members[0]][g]["partition_count"]
    if count != len(members):
        raise ValueError(f"sub-group {g} records partition_count {count} but ranks {members}")
    merged, offset = {}, 0
    for name, shape in models[members[0]]["param_shapes"][g].items():
        numel = math.prod(shape)
        part = math.ceil(numel / count)
        chunks = [flat_groups[r][g][offset:offset + part] for r in members]
        merged[name] = torch.cat(chunks)[:numel].view(shape).clone()
        offset += part
    held = flat_groups[members[0]][g].numel()
    if offset != held:
        raise ValueError(f"sub-group {g} of ranks {members}: its parameters need {offset} elements per rank, the "
                         f"checkpoint holds {held}; it was not written by this ZeRO-3 layout")
    return merged


def _ep_size(meta: dict, name: str) -> int:
    sizes = {int(n[len("ep_size_"):]) for n in meta.get("group_names", ()) if n.startswith("ep_size_")}
    if len(sizes) != 1:
        raise ValueError(f"expert parameter {name!r}: cannot tell its ep_size from the checkpoint's group names "
                         f"{meta.get('group_names')} (moe_plugin names them ep_size_<ep_size>)")
    return sizes.pop()


def _ep_rank(rank: int, expert_data_group: List[int], world: int, ep_size: int) -> int:
    """rank's place in its expert-parallel group, as DeepSpeed's groups (and so moe_plugin's layers) lay them out."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks
    parallel, data = _get_expert_parallel_ranks(world, 1, ep_size)
    if sorted(expert_data_group) not in [sorted(d) for d in data]:
        raise ValueError(f"ranks {expert_data_group} are not an expert-data-parallel group of DeepSpeed's layout "
                         f"for world size {world} and ep_size {ep_size} ({data})")
    return next(group.index(rank) for group in parallel if rank in group)


def _whole_experts(name: str, by_rank: Dict[int, torch.Tensor], shapes) -> Dict[str, torch.Tensor]:
    """One expert tensor with every expert, from each expert-parallel rank's tensor (or, on the general path,
    each rank's local expert modules renumbered to their global index)."""
    ep_size = len(by_rank)
    local = _LOCAL_EXPERT.match(name)
    layer_prefix = _layer_prefix(name)
    router = shapes.get(f"{layer_prefix}router.weight_ED", shapes.get(f"{layer_prefix}gate.wg.weight"))
    if router is None:
        raise ValueError(f"expert parameter {name!r}: no {layer_prefix}router.weight_ED in the checkpoint to tell "
                         f"its layer's number of experts")
    num_experts = router[0]
    if local:
        per_rank = num_experts // ep_size
        return {f"{layer_prefix}experts.{local['list']}.{r * per_rank + int(local['index'])}.{local['rest']}": t
                for r, t in by_rank.items()}
    tensor_name = name.rsplit(".", 1)[1]
    hidden = shapes[f"{layer_prefix}experts.w2_EHD"][1] * max(1, ep_size // num_experts)   # local slice * slices
    whole, covered = None, None
    for ep_rank, tensor in by_rank.items():
        layout = SimpleNamespace(groups=SimpleNamespace(layout=ExpertLayout(num_experts, hidden, ep_size, ep_rank)))
        pieces = expert_pieces(layout, tensor_name, tensor, writing=True)
        if whole is None:
            whole = torch.zeros(pieces.size(), dtype=tensor.dtype)
            covered = torch.zeros(pieces.size(), dtype=torch.bool)
        for offsets, piece in pieces.pieces:
            where = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
            whole[where], covered[where] = piece, True
    if not bool(covered.all()):
        raise ValueError(f"expert parameter {name!r}: the checkpoint's {ep_size} expert-parallel ranks do not hold "
                         f"all of it")
    return {name: whole}


def _layer_prefix(name: str) -> str:
    local = _LOCAL_EXPERT.match(name)
    return local["layer"] if local else name.rsplit("experts.", 1)[0]


def _frozen(models, local_experts) -> Dict[str, torch.Tensor]:
    """Frozen parameters (split over all ranks, as DeepSpeed stores them); frozen experts cannot be told apart."""
    shapes = models[0].get("frozen_param_shapes") or {}
    layers = {name.rsplit("experts.", 1)[0] for name in local_experts}
    out = {}
    for name, shape in shapes.items():
        if any(name.startswith(f"{layer}experts.") for layer in layers):
            raise ValueError(f"frozen expert parameter {name!r}: ZeRO-3 checkpoints do not record which ranks a "
                             f"frozen parameter was split over, so it cannot be consolidated at ep_size > 1; pass "
                             f"exclude_frozen_parameters=True, or train it")
        fragments = [m["frozen_param_fragments"][name] for m in models]
        out[name] = torch.cat(fragments)[:math.prod(shape)].view(shape).float()
    return out


def patch_zero_to_fp32() -> None:
    """Make deepspeed.utils.zero_to_fp32 consolidate expert-partitioned checkpoints (idempotent). A DeepSpeed
    without that module's internal function (not 0.19.8) is left as it is: enable() runs at `import deepspeed`."""
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError:
        return
    original = getattr(zero_to_fp32, "_get_fp32_state_dict_from_zero_checkpoint", None)
    if original is None or hasattr(original, _ORIGINAL):
        return

    def consolidate(ds_checkpoint_dir, exclude_frozen_parameters):
        if _is_expert_partitioned(ds_checkpoint_dir):
            return expert_partitioned_state_dict(ds_checkpoint_dir, exclude_frozen_parameters)
        if _is_zero12_moe(ds_checkpoint_dir):
            return zero12_moe_state_dict(ds_checkpoint_dir, exclude_frozen_parameters)
        return original(ds_checkpoint_dir, exclude_frozen_parameters)

    setattr(consolidate, _ORIGINAL, original)
    zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint = consolidate


def unpatch_zero_to_fp32() -> None:
    import sys
    zero_to_fp32 = sys.modules.get("deepspeed.utils.zero_to_fp32")
    patched = getattr(zero_to_fp32, "_get_fp32_state_dict_from_zero_checkpoint", None)
    if hasattr(patched, _ORIGINAL):
        zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint = getattr(patched, _ORIGINAL)


def main(argv: Optional[List[str]] = None) -> None:
    """zero_to_fp32.py's command line (checkpoint_dir output_dir [-t tag] ...), expert-partitioned checkpoints too."""
    parser = argparse.ArgumentParser(prog="python -m moe_plugin.integrations.deepspeed.zero_to_fp32",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", help="the folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", help="where the consolidated fp32 weights are written")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    patch_zero_to_fp32()
    from deepspeed.utils import zero_to_fp32
    if not hasattr(getattr(zero_to_fp32, "_get_fp32_state_dict_from_zero_checkpoint", None), _ORIGINAL):
        import deepspeed
        raise SystemExit(f"moe_plugin's zero_to_fp32 needs DeepSpeed 0.19.8's deepspeed.utils.zero_to_fp32 "
                         f"internals; this is DeepSpeed {deepspeed.__version__}")
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, tag=args.tag,
                                               max_shard_size=args.max_shard_size,
                                               safe_serialization=args.safe_serialization,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters)

