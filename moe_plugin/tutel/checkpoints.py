"""Tutel's per-rank checkpoints at any number of ranks: read the files a run of W ranks saved (Tutel's
`{rank}-of-{size}` files, Swin-MoE's `*.pth.rank{rank}` files and their `*.pth.master`), hold the model as one
process holding every expert has it (Tutel's all-in-one layout), and write it for N ranks, or with MoELayer's names.

Shape legend: moe_plugin/__init__.py (E experts, E_local one rank's, D model dim, H hidden dim per expert), plus O an
expert's output width (Tutel's output_dim, D by default) and S the ranks one expert is sliced over (S = W / E when a
run has more ranks W than experts E; otherwise 1).

One Tutel layer's expert tensors on a rank, and in the all-in-one layout (E_local = E, S = 1):
    ffn        batched_fc1_w [E_local, H/S, D], batched_fc2_w [E_local, H/S, O], batched_fc1_bias [E_local, H/S]
               and batched_fc2_bias [E_local, ceil(O/S)] (rank s of an expert's S holds O's slice s, O padded to
               S * ceil(O/S)); Swin-MoE's older files hold the biases as [E_local, 1, H] and [E_local, 1, O] and
               have no _num_global_experts
    llama_ffn  W_fc1, W_fc2, W_fc3 flat [E_local*D*H]
An expert sliced over S ranks lives on the consecutive ranks e*S .. e*S + S-1, slice r % S on rank r (Tutel's
groups). Every other tensor is replicated: every file that holds it must hold the same values.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .names import NUM_EXPERTS, tutel_to_moe

FC1_W, FC2_W, FC1_BIAS, FC2_BIAS = "batched_fc1_w", "batched_fc2_w", "batched_fc1_bias", "batched_fc2_bias"
LLAMA = ("W_fc1", "W_fc2", "W_fc3")
EXPERT_NAMES = (FC1_W, FC2_W, FC1_BIAS, FC2_BIAS) + LLAMA
_TUTEL_NAME = re.compile(r"(\d+)-of-(\d+)")
_SWIN_NAME = re.compile(r"\.rank(\d+)$")

State = Dict[str, Any]


@dataclass
class TutelCheckpoint:
    """A Tutel model as one process holding every expert has it.

    state: the model's state dict in the all-in-one layout (every layer with its _num_global_experts).
    num_experts: each MoE layer's prefix ("" or ending in ".") -> its experts.
    namespace: the keys, joined by "/", under which the files kept the state dict (Swin-MoE's "model"), or "".
    ranks: the ranks of the run that saved the files. left_out: what the files held beside the state dict."""
    state: State
    num_experts: Dict[str, int]
    namespace: str = ""
    ranks: int = 1
    left_out: List[str] = field(default_factory=list)


def rank_of(path: Path) -> Tuple[Optional[int], Optional[int]]:
    """(rank, ranks of the run) a file's name gives: `3-of-32.ckpt` (3, 32), `x.pth.rank3` (3, None), a Swin-MoE
    `x.pth.master` (None, None). ValueError for any other name."""
    found = _TUTEL_NAME.findall(path.name)
    if found:
        return int(found[-1][0]), int(found[-1][1])
    found = _SWIN_NAME.search(path.name)
    if found:
        return int(found.group(1)), None
    if path.name.endswith(".master"):
        return None, None
    raise ValueError(f"cannot tell the rank of {str(path)!r}: name the files as Tutel does ({{rank}}-of-{{size}}, "
                     f"e.g. 3-of-32.ckpt) or as Swin-MoE does (NAME.pth.rank{{rank}}, with NAME.pth.master)")


def order_files(paths: Sequence[Path]) -> Tuple[List[Path], Optional[Path]]:
    """The rank files by rank, and the Swin-MoE master file (or None). ValueError for ranks missing, twice, or of
    runs of different sizes. One file of any name is an all-in-one checkpoint (one rank)."""
    if len(paths) == 1 and not _TUTEL_NAME.search(Path(paths[0]).name) and not _SWIN_NAME.search(Path(paths[0]).name):
        return [Path(paths[0])], None
    by_rank: Dict[int, Path] = {}
    worlds: Dict[int, List[str]] = {}
    masters = []
    for path in map(Path, paths):
        rank, world = rank_of(path)
        if rank is None:
            masters.append(path)
            continue
        if rank in by_rank:
            raise ValueError(f"rank {rank} is given twice: {str(by_rank[rank])!r} and {str(path)!r}")
        by_rank[rank] = path
        worlds.setdefault(world, []).append(path.name)
    if len(masters) > 1:
        raise ValueError(f"several master files: {[str(m) for m in masters]}; give one run's files")
    if not by_rank:
        raise ValueError("no rank files among the inputs: give every rank's file (and Swin-MoE's .master)")
    named = {w: names for w, names in worlds.items() if w is not None}
    if len(named) > 1 or (named and None in worlds):
        sizes = {str(w): names[:2] for w, names in worlds.items()}
        raise ValueError(f"the files come from runs of different sizes: {sizes}; give one run's files")
    world = next(iter(named)) if named else max(by_rank) + 1
    beyond = sorted(r for r in by_rank if r >= world)
    if beyond:
        raise ValueError(f"{str(by_rank[beyond[0]])!r} is rank {beyond[0]} of a run of {world} ranks")
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"the files of ranks {shown} are missing: a run of {world} ranks needs one file per rank "
                         f"(got {len(by_rank)})")
    return [by_rank[r] for r in range(world)], (masters[0] if masters else None)


def load_file(path: Path, namespace: Optional[str]) -> Tuple[State, str, List[str]]:
    """(the state dict in the file, its namespace, the file's other top-level keys). namespace None: the file itself
    when it is a state dict, else its "model" entry (Swin-MoE's)."""
    try:
        bundle = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:   # torch.load raises many kinds for a file that is not its own
        first = str(error).strip().splitlines()[0]
        if "can still be loaded" in str(error):     # torch: only weights_only=False would load it
            raise ValueError(f"{str(path)!r} holds Python objects beside its tensors (a training config?), which are "
                             f"not loaded here ({first}); from a file you trust, save its state dict alone: "
                             f"torch.save(torch.load(FILE, weights_only=False)['model'], NEW_FILE)") from None
        raise ValueError(f"{str(path)!r} is not a checkpoint torch.load reads: {first}") from None
    if namespace is None:
        namespace = "" if _is_state(bundle) else "model" if isinstance(bundle, dict) and "model" in bundle else ""
    state, left_out, where = bundle, [], ""
    for package in filter(None, namespace.split("/")):
        if not isinstance(state, dict) or package not in state:
            raise ValueError(f"{str(path)!r} has no {package!r} entry (namespace={namespace!r})")
        left_out += [f"{where}{k}" for k in state if k != package]
        state, where = state[package], f"{where}{package}/"
    if not _is_state(state):
        raise ValueError(f"{str(path)!r} does not hold a state dict (name: tensor) under namespace={namespace!r}")
    return dict(state), namespace, left_out


def _is_state(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def read(paths: Sequence[Path], namespace: Optional[str] = None, num_experts: Optional[int] = None) -> TutelCheckpoint:
    """Every rank's file of one run (and Swin-MoE's master file) as one all-in-one checkpoint.
    num_experts: the experts of layers whose files say neither (no _num_global_experts, no gate); else checked."""
    files, master = order_files(paths)
    states, namespaces, left_out = [], set(), set()
    for path in files:
        state, space, others = load_file(path, namespace)
        states.append(state)
        namespaces.add(space)
        left_out.update(others)
    if len(namespaces) > 1:
        raise ValueError(f"the rank files keep their state dicts under different entries {sorted(namespaces)}")
    space = namespaces.pop()
    shared: State = {}
    if master is not None:
        shared, _, others = load_file(master, space)
        left_out.update(others)
    named = [(str(p), s) for p, s in zip(files, states)]
    state, counts = gather(named, (str(master), shared) if master is not None else None, num_experts)
    return TutelCheckpoint(state, counts, space, len(files), sorted(left_out))


def gather(named_states: Sequence[Tuple[str, State]], master: Optional[Tuple[str, State]] = None,
           num_experts: Optional[int] = None) -> Tuple[State, Dict[str, int]]:
    """(file name, its state dict) of ranks 0..W-1, and Swin-MoE's master file's (its replicated tensors) -> (the
    all-in-one state dict, each layer's experts). Pure: on dicts of tensors."""
    rank_states = [s for _, s in named_states]
    prefixes = layer_prefixes([k for _, s in named_states for k in s])
    if master is not None:
        experts = [k for k in master[1] if _is_expert_key(k, prefixes)]
        if experts:
            raise ValueError(f"the master file {master[0]!r} holds expert tensors ({experts[0]}, ...): a master file "
                             f"holds the replicated tensors only; the experts come from the rank files")
        named_states = list(named_states) + [master]
    replicated = _replicated(named_states, prefixes, len(rank_states))
    counts = {p: _experts_of(p, replicated, rank_states, num_experts) for p in prefixes}
    state = dict(replicated)
    for prefix, E in counts.items():
        state[prefix + NUM_EXPERTS] = torch.tensor(E)
        for name in _expert_names(prefix, rank_states):
            pieces = [s[prefix + "experts." + name] for s in rank_states]
            state[prefix + "experts." + name] = _join(prefix + "experts." + name, pieces, E)
        fc2_bias, fc2_w = state.get(prefix + "experts." + FC2_BIAS), state.get(prefix + "experts." + FC2_W)
        if fc2_bias is not None and fc2_w is not None and fc2_bias.shape[1] != fc2_w.shape[2]:
            if len(rank_states) <= E or fc2_bias.shape[1] < fc2_w.shape[2]:
                raise ValueError(f"layer {prefix!r}: batched_fc2_bias has {fc2_bias.shape[1]} columns, batched_fc2_w "
                                 f"{fc2_w.shape[2]}")
            state[prefix + "experts." + FC2_BIAS] = fc2_bias[:, :fc2_w.shape[2]].contiguous()   # O's padding
    return {k: state[k] for k in _key_order(named_states, state)}, counts


def layer_prefixes(keys: Sequence[str]) -> List[str]:
    """The prefixes ("" or ending in ".") of the Tutel MoE layers among a state dict's keys, in key order."""
    prefixes: List[str] = []
    for key in keys:
        prefix = None
        if key.endswith(NUM_EXPERTS) and (key == NUM_EXPERTS or key[-len(NUM_EXPERTS) - 1] == "."):
            prefix = key[:-len(NUM_EXPERTS)]
        for name in EXPERT_NAMES:
            leaf = "experts." + name
            if key.endswith(leaf) and (key == leaf or key[-len(leaf) - 1] == "."):
                prefix = key[:-len(leaf)]
        if prefix is not None and prefix not in prefixes:
            prefixes.append(prefix)
    return prefixes


def _is_expert_key(key: str, prefixes: Sequence[str]) -> bool:
    return any(key.startswith(prefix + "experts.") for prefix in prefixes)


def _replicated(named_states: Sequence[Tuple[str, State]], prefixes: Sequence[str], ranks: int) -> State:
    """Every tensor but the experts, checked to be the same in every file that holds it and held by every rank's
    file or none (the first `ranks` files are the ranks'; a master file may follow)."""
    out: State = {}
    where: Dict[str, str] = {}
    held = []
    for i, (name, state) in enumerate(named_states):
        keys = {k for k in state if not _is_expert_key(k, prefixes)}
        if i < ranks:
            held.append((name, keys))
        for key in sorted(keys):
            value = state[key]
            if key not in out:
                out[key], where[key] = value, name
            elif not _same(out[key], value):
                raise ValueError(f"the replicated tensor {key!r} differs between {where[key]!r} and {name!r} "
                                 f"({_describe(out[key])} vs {_describe(value)}): the files are not one run's "
                                 f"checkpoint, or a rank's copy drifted; no file's value is picked")
    for (first, keys), (name, other) in zip(held, held[1:]):
        if keys != other:
            odd = sorted(keys ^ other)[:3]
            raise ValueError(f"{first!r} and {name!r} hold different non-expert tensors (e.g. {odd}): the files are "
                             f"not one run's checkpoint")
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))   # bit for bit (NaNs too)


def _describe(t: torch.Tensor) -> str:
    if t.dtype != torch.bool and t.numel() and t.is_floating_point():
        return f"{t.dtype} {list(t.shape)}, sum {float(t.double().sum()):.6g}"
    return f"{t.dtype} {list(t.shape)}"


def _expert_names(prefix: str, rank_states: Sequence[State]) -> List[str]:
    names = [k[len(prefix) + len("experts."):] for k in rank_states[0] if k.startswith(prefix + "experts.")]
    unknown = [n for n in names if n not in EXPERT_NAMES]
    if unknown:
        raise ValueError(f"layer {prefix!r} has expert tensors {unknown}: only Tutel's ffn {list(EXPERT_NAMES[:4])} "
                         f"and llama_ffn {list(LLAMA)} experts are converted (custom experts have layouts of their own)")
    for r, state in enumerate(rank_states):
        held = [k[len(prefix) + len("experts."):] for k in state if k.startswith(prefix + "experts.")]
        if sorted(held) != sorted(names):
            raise ValueError(f"rank {r}'s file holds expert tensors {sorted(held)} of layer {prefix!r}, rank 0's "
                             f"{sorted(names)}")
    return names


def _experts_of(prefix: str, replicated: State, rank_states: Sequence[State], given: Optional[int]) -> int:
    """A layer's experts: its _num_global_experts, else its gate's width, else given; each checked against the others."""
    said = {}
    if prefix + NUM_EXPERTS in replicated:
        said["_num_global_experts"] = int(replicated[prefix + NUM_EXPERTS])
    for key, value in replicated.items():
        gate = key[len(prefix):] if key.startswith(prefix + "gates.") else ""
        if gate.endswith(".wg.weight") and value.dim() == 2:
            said[gate] = value.shape[0]
        elif gate.endswith(".sim_matrix") and value.dim() == 2:
            said[gate] = value.shape[1]
    if given is not None:
        said["num_experts"] = given
    if not said:
        raise ValueError(f"layer {prefix!r} says not how many experts it has (no _num_global_experts, no gate in the "
                         f"files): give num_experts (--num-experts)")
    if len(set(said.values())) > 1:
        raise ValueError(f"layer {prefix!r}: the expert counts disagree: {said}")
    E, W = next(iter(said.values())), len(rank_states)
    if E % W and W % E:
        raise ValueError(f"layer {prefix!r} has {E} experts, which neither divide over the files' {W} ranks nor "
                         f"{W} ranks over them (is a rank's file missing?)")
    return E


def _join(key: str, pieces: List[torch.Tensor], E: int) -> torch.Tensor:
    """One expert tensor of every rank (rank order) -> its all-in-one tensor over E experts."""
    name, W = key.rsplit(".", 1)[1], len(pieces)
    S = max(W // E, 1)
    E_local = E // W if W <= E else 1
    flat = name in LLAMA
    if flat and S > 1:
        raise ValueError(f"{key}: llama_ffn experts sliced over ranks ({E} experts on {W} ranks) keep flat padded "
                         f"pieces whose sizes do not tell the padding; only whole experts per rank are converted")
    shapes = {tuple(p.shape) for p in pieces}
    if len(shapes) > 1:
        raise ValueError(f"{key} has different shapes on different ranks: {sorted(shapes)}")
    if flat:
        return torch.cat([p.reshape(-1) for p in pieces])
    lead = pieces[0].shape[0] if pieces[0].dim() else 0
    if lead != E_local or (name in (FC1_W, FC2_W) and pieces[0].dim() != 3):
        raise ValueError(f"{key} is {list(pieces[0].shape)} on each rank, but {E} experts on {W} ranks hold "
                         f"{E_local} each: [{E_local}, ...] expected (a file of another run, or of another layer?)")
    if name in (FC1_BIAS, FC2_BIAS):
        if pieces[0].dim() == 3 and pieces[0].shape[1] != 1 or pieces[0].dim() not in (2, 3):
            raise ValueError(f"{key} is {list(pieces[0].shape)} on each rank: [{E_local}, width] or Swin-MoE's "
                             f"[{E_local}, 1, width] expected")
        pieces = [p.reshape(E_local, -1) for p in pieces]
    if S == 1:
        return torch.cat(pieces)
    dim = 1   # the hidden dim of the weights, the width of the biases
    whole = [torch.cat(pieces[e * S:(e + 1) * S], dim=dim) for e in range(E)]
    return torch.cat(whole)


def _key_order(named_states: Sequence[Tuple[str, State]], state: State) -> List[str]:
    """The rank-0 file's key order, then the master's, then the added _num_global_experts."""
    order: List[str] = []
    seen = set()
    for _, s in named_states:
        for key in s:
            if key in state and key not in seen:
                order.append(key)
                seen.add(key)
    return order + [k for k in state if k not in seen]


def scatter(state: State, num_experts: Dict[str, int], ranks: int) -> List[State]:
    """The all-in-one state dict -> the state dict of each of `ranks` ranks, as Tutel's moe_layer at that world size
    holds it (count_per_node E / ranks, or -(ranks / E) with more ranks than experts). Pure: on dicts of tensors."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks={ranks!r} is invalid: must be an integer >= 1")
    for prefix, E in num_experts.items():
        if E % ranks and ranks % E:
            fits = sorted({d for d in range(1, E + 1) if E % d == 0} | {E * m for m in (2, 4, 8)})
            raise ValueError(f"ranks={ranks} is invalid for layer {prefix!r}: its {E} experts neither divide over "
                             f"{ranks} ranks nor {ranks} ranks over them (e.g. {fits})")
    out = []
    for r in range(ranks):
        rank_state = {}
        for key, value in state.items():
            prefix = next((p for p in num_experts if key.startswith(p + "experts.")), None)
            rank_state[key] = value if prefix is None else _split(key, value, num_experts[prefix], ranks, r)
        out.append(rank_state)
    return out


def _split(key: str, full: torch.Tensor, E: int, W: int, r: int) -> torch.Tensor:
    """Rank r's piece (a copy: torch.save writes a view's whole storage) of one all-in-one expert tensor."""
    name = key.rsplit(".", 1)[1]
    if W <= E:
        E_local = E // W
        if name in LLAMA:
            n = full.numel() // E
            return full[r * E_local * n:(r + 1) * E_local * n].clone()
        return full[r * E_local:(r + 1) * E_local].clone()
    if name in LLAMA:
        raise ValueError(f"{key}: llama_ffn experts sliced over ranks ({E} experts on {W} ranks) are not written: "
                         f"their flat padded pieces could not be read back")
    S = W // E
    e, s = divmod(r, S)
    width = full.shape[1]
    if name == FC2_BIAS:
        c = math.ceil(width / S)
        padded = torch.cat([full[e], full.new_zeros(S * c - width)])
        return padded[s * c:(s + 1) * c].reshape(1, c).clone()
    if width % S:
        raise ValueError(f"{key}: the hidden size {width} does not divide into the {S} slices of an expert that "
                         f"{E} experts on {W} ranks need (Tutel requires hidden_size_per_expert % {S} == 0)")
    h = width // S
    return full[e:e + 1, s * h:(s + 1) * h].clone()


def rank_path(pattern: str, rank: int, ranks: int) -> Path:
    """Tutel's file pattern with {rank} and {size} filled in."""
    return Path(pattern.replace("{rank}", str(rank)).replace("{size}", str(ranks)))


def write(checkpoint: TutelCheckpoint, pattern: str, ranks: int) -> List[Path]:
    """One file per rank of a run of `ranks` ranks (under the checkpoint's namespace, as the files it was read from);
    pattern holds {rank} (and optionally {size}) unless ranks is 1. Returns the files written."""
    if ranks > 1 and "{rank}" not in pattern:
        raise ValueError(f"the output {pattern!r} has no {{rank}}: {ranks} ranks need one file each (e.g. "
                         f"out/{{rank}}-of-{{size}}.ckpt)")
    paths = [rank_path(pattern, r, ranks) for r in range(ranks)]
    for path, state in zip(paths, scatter(checkpoint.state, checkpoint.num_experts, ranks)):
        _save(_nested(state, checkpoint.namespace), path)
    return paths


def to_moe(checkpoint: TutelCheckpoint, gate: Optional[int] = None) -> State:
    """The model's state dict with every Tutel layer in MoELayer's names and layouts (moe_plugin.tutel.names), all
    experts in each: what MoELayer.load_full_state_dict (per layer) and train.load_full_state_dict (a model) read."""
    out = dict(checkpoint.state)
    for prefix, E in checkpoint.num_experts.items():
        layer = {k[len(prefix):]: out.pop(k) for k in list(out) if k.startswith(prefix) and _in_layer(k[len(prefix):])}
        converted = tutel_to_moe(layer, gate, num_local_experts=E)
        out.update({prefix + k: v for k, v in converted.items()})
    return out


def _in_layer(key: str) -> bool:
    return key == NUM_EXPERTS or key.startswith(("experts.", "gates."))


def _nested(state: State, namespace: str) -> Any:
    for package in reversed([p for p in namespace.split("/") if p]):
        state = {package: state}
    return state


def _save(obj: Any, path: Path) -> None:
    """torch.save into path.tmp, then renamed: a file with its final name is whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def check_targets(targets: Sequence[Path], sources: Sequence[Path], overwrite: bool) -> None:
    """ValueError unless every target may be written: never a source (--overwrite included), and an existing file
    only with overwrite; checked before anything is read or written."""
    given = {Path(source).resolve() for source in sources}
    for path in targets:
        if path.resolve() in given:
            raise ValueError(f"{str(path)!r} is one of the source files: convert never writes over its own source "
                             f"(--overwrite included); give another output")
        if path.is_dir():
            raise ValueError(f"{str(path)!r} is a folder: --from tutel writes files there; give a file (pattern)")
        if path.exists() and not overwrite:
            raise ValueError(f"{str(path)!r} exists: convert does not replace it unless asked; add --overwrite to "
                             f"replace it, or give another output")


def convert(sources: Sequence[Path], target: str, ranks: Optional[int] = None, to: str = "tutel",
            namespace: Optional[str] = None, num_experts: Optional[int] = None, gate: Optional[int] = None,
            overwrite: bool = False) -> str:
    """`moe-plugin checkpoint convert --from tutel`: one run's files -> `ranks` Tutel files, or (to "moe_plugin") one
    state dict in MoELayer's names. An existing output is replaced only with overwrite, a source never. Returns what
    was written, in words."""
    if to not in ("tutel", "moe_plugin"):
        raise ValueError(f"--to={to!r} is invalid: must be tutel or moe_plugin")
    if to == "tutel" and ranks is None:
        raise ValueError("--ranks is required with --from tutel: the number of ranks to write files for (1: one "
                         "all-in-one file), or --to moe_plugin for one state dict in MoELayer's names")
    if to == "moe_plugin" and ranks is not None:
        raise ValueError(f"--ranks={ranks} is invalid with --to moe_plugin: its state dict holds every expert, and "
                         f"each rank keeps its own share when loading it (load_full_state_dict)")
    if to == "tutel" and gate is not None:
        raise ValueError(f"--gate={gate} is invalid with --to tutel: Tutel's files keep every gate; --gate picks the "
                         f"one that becomes MoELayer's router (--to moe_plugin)")
    if num_experts is not None and num_experts < 1:
        raise ValueError(f"--num-experts={num_experts} is invalid: must be an integer >= 1")
    if to == "tutel" and ranks > 1 and "{rank}" not in target:
        raise ValueError(f"the output {target!r} has no {{rank}}: {ranks} ranks need one file each (e.g. "
                         f"out/{{rank}}-of-{{size}}.ckpt)")
    check_targets([Path(target)] if to == "moe_plugin" else [rank_path(target, r, ranks) for r in range(ranks)],
                  sources, overwrite)
    checkpoint = read(sources, namespace, num_experts)
    layers = ", ".join(f"{E}" for E in checkpoint.num_experts.values())
    read_from = (f"read {len(checkpoint.num_experts)} MoE layers ({layers} experts) from a run of {checkpoint.ranks} "
                 f"rank{'s' if checkpoint.ranks > 1 else ''}")
    if checkpoint.left_out:
        read_from += f"; left out the files' {', '.join(map(repr, checkpoint.left_out))} (only the model is converted)"
    if to == "moe_plugin":
        _save(to_moe(checkpoint, gate), Path(target))
        return f"{read_from}\nwrote {target}: the model's state dict with MoELayer's names, every expert in each layer"
    written = write(checkpoint, target, ranks)
    where = str(written[0]) if ranks == 1 else f"{written[0]} ... {written[-1]}"
    return f"{read_from}\nwrote {where}: Tutel's layout for {ranks} rank{'s' if ranks > 1 else ''}"
