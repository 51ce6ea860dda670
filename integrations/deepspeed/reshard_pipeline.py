"""A DeepSpeed PipelineModule's MoE checkpoint (ZeRO 0 or 1, fp32) loaded at another number of pipeline stages,
data-parallel size per stage or ep_size, with its optimizer state.

A pipeline's files are per stage: DeepSpeed names stage s's model file mp_rank_<s>_model_states.pt (the stage's
dense weights and buffers; the scheduler and step counters are the same in every stage's), its experts'
layer_<i>_expert_<e>_mp_rank_<s>_model_states.pt (i counts the stage's MoE layers from 0, e is the global expert id),
and its optimizer files zero_pp_rank_<d>_mp_rank_<s>_optim_states.pt (ZeRO 1: d the data-parallel rank in the
stage) or expp_rank_<e>_mp_rank_<s>_optim_states.pt (ZeRO 0). Inside a stage the files are those of a run without
pipelining on the stage's data-parallel ranks, so reshard.SavedState reads them (StageState). A pipeline's parameter
names start with their global layer index ("2.norm.weight"), whatever the stages: each name is looked up in the
saved stage that held it.

At save, each stage's first data-parallel rank writes STAGE_FILE beside layout.py's LAYOUT_FILE (which rank 0 writes
for its own stage): the stage's MoE layers' ep_sizes, its DeepSpeed MoE layers in the order DeepSpeed numbers their
expert files, expert shapes, parameter names and, at ZeRO 0, its optimizer's parameter order. At load,
layout.check_layout compares this stage's part of the saved layout (this_stage) with the current one; a conversion
sets the weights from the saved files (DeepSpeed's own load reads stage s's files, which at another number of
stages hold other layers), the scheduler, the step counters and the optimizer state (load_pipeline_checkpoint).
Each rank reads only its own parameters' tensors (files opened with mmap), as reshard.py does.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.integrations.deepspeed.reshard import (SavedState, _read, load_engine_state, local_state,
                                                       write_optimizer_state)

__all__ = ["STAGE_FILE", "write_stage_record", "this_stage", "load_pipeline_checkpoint"]

STAGE_FILE = "moe_plugin_layout_stage_{:02d}.json"


def _is_pipeline(engine) -> bool:
    from deepspeed.pipe import PipelineModule
    return isinstance(engine.module, PipelineModule)


def write_stage_record(engine, folder: str, record: Dict[str, Any]) -> None:
    """This stage's part of the layout, by its first data-parallel rank (record: this rank's layout.py record)."""
    if not _is_pipeline(engine) or engine.grid.get_data_parallel_rank() != 0:
        return
    os.makedirs(folder, exist_ok=True)
    stage = {key: record[key] for key in ("ep_size", "experts", "optimizer_names") if key in record}
    stage["params"] = [name for name, _ in engine.module.named_parameters()]
    stage["moe_layers"] = _deepspeed_moe_layers(engine.module)
    with open(os.path.join(folder, STAGE_FILE.format(engine.stage_id)), "w") as f:
        json.dump(stage, f)


def _deepspeed_moe_layers(module: nn.Module) -> List[str]:
    """The names of module's DeepSpeed MoE layers in the order DeepSpeed numbers their expert files."""
    from deepspeed.moe.layer import MoE
    return [name for name, layer in module.named_modules() if isinstance(layer, MoE)]


def this_stage(folder: str, saved: Dict[str, Any], current: Dict[str, Any]) -> Dict[str, Any]:
    """The saved layout as this rank's stage sees it: its MoE layers' saved ep_sizes and expert shapes, and each
    saved stage's record ("stages") where reshard_pipeline converts it; otherwise why not ("pipeline_refusal"). A
    layout of neither run a PipelineModule is returned as it is."""
    saved_pipeline = saved.get("pipeline_module", current.get("pipeline_module"))   # a record from before it
    if not saved_pipeline and not current.get("pipeline_module"):
        return saved
    if not saved_pipeline or not current.get("pipeline_module"):
        whose = "the saved" if saved_pipeline else "this run's"
        return {**saved, "pipeline_refusal": f"only {whose} model is a PipelineModule (its parameters' names differ)"}
    paths = [os.path.join(folder, STAGE_FILE.format(s)) for s in range(saved["pipeline_stages"])]
    missing = [os.path.basename(path) for path in paths if not os.path.isfile(path)]
    if missing:
        return {**saved, "pipeline_refusal": f"the checkpoint has no {missing[0]} (written by each pipeline stage "
                                             f"that holds an MoE layer, since this conversion was added)"}
    stages = []
    for path in paths:
        with open(path) as f:
            stages.append(json.load(f))
    ep_size = {layer: size for stage in stages for layer, size in stage["ep_size"].items()}
    experts = {name: shape for stage in stages for name, shape in stage["experts"].items()}
    mine = tuple(layer + "." for layer in current["ep_size"])
    view = {**saved, "ep_size": {layer: size for layer, size in ep_size.items() if layer in current["ep_size"]},
            "experts": {name: shape for name, shape in experts.items() if name.startswith(mine)}}
    empty = [s for s, stage in enumerate(stages) if not stage["ep_size"]]
    if empty:
        return {**view, "pipeline_refusal": f"saved pipeline stage {empty[0]} holds no MoE layer (DeepSpeed wrote its "
                                            f"weights in per-layer files; converted: every stage holding one)"}
    if saved.get("dtype") != "fp32" or saved.get("zero_stage") not in (0, 1):
        return {**view, "pipeline_refusal": f"a PipelineModule saved at ZeRO stage {saved.get('zero_stage')} in "
                                            f"{saved.get('dtype')} (converted: ZeRO 0 and 1 in fp32)"}
    return {**view, "stages": stages}


class StageState(SavedState):
    """SavedState of one saved pipeline stage: its files as a run without pipelining on the stage's data-parallel
    ranks (mp_rank_<stage> for mp_rank_00)."""

    def __init__(self, folder: str, saved: Dict[str, Any], stage: int):
        self.pipe_stage = stage
        record = saved["stages"][stage]
        super().__init__(folder, {**saved, "world_size": saved["world_size"] // saved["pipeline_stages"],
                                  "ep_size": record["ep_size"], "experts": record["experts"],
                                  "optimizer_names": record.get("optimizer_names")})

    def _load(self, name: str):
        return super()._load(name.replace("mp_rank_00", f"mp_rank_{self.pipe_stage:02d}"))


class PipelineState:
    """The saved pipeline's optimizer state and weights, one parameter at a time from the stage that held it."""

    def __init__(self, folder: str, saved: Dict[str, Any]):
        self.folder = folder
        self.stages = [StageState(folder, saved, s) for s in range(saved["pipeline_stages"])]
        self._stage = {name: s for s, record in enumerate(saved["stages"]) for name in record["params"]}
        self._moe_layer = {layer: (s, i) for s, record in enumerate(saved["stages"])
                           for i, layer in enumerate(record["moe_layers"])}

    def local(self, name: str, ep_rank: int, ep_size: int) -> Dict[str, torch.Tensor]:
        if name not in self._stage:
            raise ValueError(f"{self.folder}: no saved pipeline stage holds parameter {name!r}")
        return self.stages[self._stage[name]].local(name, ep_rank, ep_size)

    def param_groups(self) -> List[Dict[str, Any]]:
        return self.stages[0].param_groups()

    def model_file(self, stage: int) -> Dict[str, Any]:
        return self.stages[stage]._load("mp_rank_00_model_states.pt")

    def expert_file(self, layer: str, expert: int) -> Dict[str, torch.Tensor]:
        """Expert `expert` (global id) of MoE layer `layer` as the saved stage that held it wrote it."""
        if layer not in self._moe_layer:
            raise ValueError(f"{self.folder}: no saved pipeline stage holds MoE layer {layer!r}")
        stage, index = self._moe_layer[layer]
        return self.stages[stage]._load(f"layer_{index}_expert_{expert}_mp_rank_00_model_states.pt")

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


def load_pipeline_checkpoint(engine, folder: str, saved: Dict[str, Any], current: Dict[str, Any],
                             load_lr_scheduler_states: bool = True) -> Tuple[str, Dict[str, Any]]:
    """What engine.load_checkpoint gives, from a pipeline checkpoint in another layout (this_stage gave saved):
    the weights and buffers of this rank's layers, the LR scheduler, global_steps, global_samples, skipped_steps and
    the optimizer state of its parameters. Returns (folder, the client state)."""
    source = PipelineState(folder, saved)
    with torch.no_grad():
        engine.module.load_state_dict(_module_state(engine, source), strict=True)
    client = load_engine_state(engine, source.model_file(0), load_lr_scheduler_states)
    write_optimizer_state(engine.optimizer, local_state(engine, source, current), source, "fp32")
    source.close()
    if dist.is_initialized():
        dist.barrier()
    return folder, client


def _module_state(engine, source: PipelineState) -> Dict[str, torch.Tensor]:
    """This stage's state dict (DeepSpeed's names: each local expert as deepspeed_experts.<local id>) from the saved
    stages' files: dense tensors by their layer's global index, experts by their global id."""
    from deepspeed.utils import groups
    layers = {name.split(".")[0] for name in engine.module.state_dict()}
    state: Dict[str, torch.Tensor] = {}
    for s in range(len(source.stages)):
        module = source.model_file(s)["module"]
        state.update({name: _read(tensor) for name, tensor in module.items() if name.split(".")[0] in layers})
    for layer in _deepspeed_moe_layers(engine.module):
        module = engine.module.get_submodule(layer)
        first = groups._get_expert_parallel_rank(module.expert_group_name) * module.num_local_experts
        prefix = f"{layer}.deepspeed_moe.experts.deepspeed_experts."
        for local in range(module.num_local_experts):
            expert = source.expert_file(layer, first + local)
            state.update({name.replace(f"{prefix}{first + local}.", f"{prefix}{local}."): _read(tensor)
                          for name, tensor in expert.items()})
    return state

