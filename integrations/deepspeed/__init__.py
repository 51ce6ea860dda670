"""DeepSpeed backend: `"moe": {"backend": "tutel", ...}` in the DeepSpeed JSON runs moe_plugin's layer.

`initialize` has deepspeed.initialize's signature: it reads the "moe" section, swaps every native MoE layer
(or a Hugging Face model's MoE blocks) for moe_plugin's layer (weights carried over), builds the MoE optimizer
groups and calls deepspeed.initialize.

One job per file: section.py (the "moe" section's keys and validation), native.py (the native layer `MoE`
and swap_moe_layers), hf.py (Hugging Face blocks under DeepSpeed), zero3.py (ZeRO stage 3 placement),
model.py (a small native-MoE demo model and its synthetic task), layout.py (checkpoints' layout, checked at load),
reshard.py (a checkpoint's optimizer state converted to another layout at load), consolidate.py (zero_to_fp32 for
expert-parallel checkpoints).
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
    from deepspeed.moe.layer import MoE as NativeMoE
    from deepspeed.moe.utils import configure_moe_param_groups
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(f"moe_plugin.integrations.deepspeed needs DeepSpeed ({error}); "
                      f"install it with: pip install 'moe_plugin[deepspeed]'") from error

from moe_plugin import MoELayer, begin_step, update_expert_bias
from moe_plugin.integrations.deepspeed.native import DeepSpeedMoELayer, MoE, moe_config, swap_moe_layers
from moe_plugin.integrations.deepspeed.hook import enable  # noqa: F401  (re-exported)
from moe_plugin.integrations.deepspeed.layout import check_layout_on_load
from moe_plugin.integrations.deepspeed.routing import log_routing, routing_alarm
from moe_plugin.integrations.deepspeed.section import SECTION_KEYS, check_ep_size_under_deepspeed, read_moe_section
from moe_plugin.integrations.deepspeed.zero3 import (Zero3MoE, check_zero3_config, hf_support,
                                                     gather_every_expert_on_16bit_save, to_zero3, zero_stage)

__all__ = ["MoE", "DeepSpeedMoELayer", "Zero3MoE", "initialize", "check_expert_parallel_layers", "read_moe_section",
           "moe_config", "swap_moe_layers", "to_zero3", "SECTION_KEYS", "enable"]


def _remap(params, replaced: Dict[int, List[nn.Parameter]]) -> list:
    """Parameters (or param-group dicts) with the swapped layers' parameters replaced, each kept once."""
    out, seen = [], set()
    for item in params:
        if isinstance(item, Mapping):
            out.append({**item, "params": _remap(item["params"], replaced)})
            continue
        for param in replaced.get(id(item), [item]):
            if id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    return out


def _config_dict(args, config, config_params) -> Dict[str, Any]:
    """The DeepSpeed config deepspeed.initialize will read, as a dict."""
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("DeepSpeed needs a config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    return load_ds_config(config)


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu: Any = None, dist_init_required: Optional[bool] = None, collate_fn=None,
               config=None, mesh_param: Any = None, config_params=None):
    """deepspeed.initialize, after applying the config's "moe" section to model (see swap_moe_layers).

    HF blocks swapped beforehand (swap_moe_blocks, upcycle: plain HFMoEBlocks) become DeepSpeed MoE layers in place
    (hf.use_deepspeed_blocks). Every ep_size (the section's, each layer's) must divide the number of processes (per
    pipeline stage): a ValueError naming it, before DeepSpeed builds its expert groups.

    Optimizer parameters come from model_parameters (parameters or param groups; default: every
    parameter that requires grad) with the swapped layers' parameters replaced, split into DeepSpeed's
    MoE groups. A client optimizer must then be a callable (params -> Optimizer), or an Optimizer with
    no state yet, whose groups are remapped in place. Returns deepspeed.initialize's tuple.
    """
    if model is None:
        raise ValueError("initialize needs a model")
    ds_config = _config_dict(args, config, config_params)
    section = read_moe_section(ds_config)
    alarm = routing_alarm((ds_config.get("moe") or {}).get("routing_alarm", True))
    autoep = ds_config.get("expert_parallel")
    if section is not None and isinstance(autoep, Mapping) and autoep.get("enabled", False):
        raise ValueError("the DeepSpeed config has a \"moe\" section (moe_plugin) and an enabled \"expert_parallel\" "
                         "section (DeepSpeed's AutoEP): both replace the model's MoE blocks; keep one (remove "
                         "\"expert_parallel\" or set its \"enabled\": false; its autoep_size is \"moe.ep_size\" here)")
    if "moe_plugin.integrations.transformers" in sys.modules:   # loaded wherever a model holds swapped HF blocks
        hf_support().use_deepspeed_blocks(model)
    has_moe = any(isinstance(m, NativeMoE) for m in model.modules())
    pipeline = _is_pipeline(model)
    swap_hf = section is not None and not has_moe and not pipeline
    if swap_hf:   # no DeepSpeed MoE layer: a Hugging Face MoE model, or an error naming what was looked for
        hf_support().check_section_for_model(model, section)
        has_moe = True
    stage3 = has_moe and zero_stage(ds_config) == 3
    if stage3:
        check_zero3_config(ds_config, mpu)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=distributed_port, dist_init_required=dist_init_required)
    use_pipeline_topology(model)
    if pipeline and section is not None:
        check_every_stage_holds_moe(model, has_moe)
    check_ep_sizes(model, section)
    replaced: Dict[int, List[nn.Parameter]] = {}
    if swap_hf:
        model, replaced = hf_support().swap_for_section(model, section)
    elif section is not None:
        model, replaced = swap_moe_layers(model, section)
    check_expert_parallel_layers(model)
    count_balance_in_stage(model)
    if stage3:
        model = to_zero3(model)
    if has_moe:
        if model_parameters is None:
            model_parameters = [p for p in model.parameters() if p.requires_grad]
        model_parameters = configure_moe_param_groups(_remap(list(model_parameters), replaced))
        if isinstance(optimizer, torch.optim.Optimizer) and replaced:
            if optimizer.state:
                raise ValueError("the optimizer passed to initialize already has state for the native MoE layers' "
                                 "parameters, which initialize replaces; pass a callable (params -> Optimizer) or "
                                 "an optimizer that has not stepped yet")
            for group in optimizer.param_groups:
                group["params"] = _remap(group["params"], replaced)
        if isinstance(optimizer, torch.optim.Optimizer) and zero_stage(ds_config) in (1, 2):
            split_client_optimizer(optimizer)
    engine, *rest = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                         model_parameters=model_parameters, training_data=training_data,
                                         lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                                         dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                         mesh_param=mesh_param, config_params=config_params)
    mark_steps(engine)
    if has_moe:
        check_layout_on_load(engine)
    log_routing(engine, alarm)
    if stage3:
        gather_every_expert_on_16bit_save(engine)
    return (engine, *rest)


def check_ep_sizes(model: nn.Module, section: Optional[Mapping[str, Any]]) -> None:
    """ValueError unless the section's ep_size and every MoE layer's divide the number of processes per pipeline
    stage (torch.distributed started): DeepSpeed's own check is a bare AssertionError deep inside its groups."""
    if section is not None and "ep_size" in section:
        check_ep_size_under_deepspeed(section["ep_size"], "DeepSpeed config \"moe.ep_size\"")
    for name, module in model.named_modules():
        if isinstance(module, NativeMoE):
            check_ep_size_under_deepspeed(module.ep_size, f"MoE layer {name or 'model'!r} ep_size")


def check_expert_parallel_layers(model: nn.Module) -> None:
    """ValueError for an expert-parallel MoELayer that DeepSpeed would not see as MoE (one outside a DeepSpeed MoE
    module: a bare MoELayer; swapped HF blocks are made DeepSpeed MoE layers first). DeepSpeed takes its experts for
    replicated dense weights: it broadcasts rank 0's experts to every rank and averages their gradients over ranks
    that hold other experts (measured: rank 1's experts became rank 0's, and nothing warned)."""
    held = {id(m) for moe in model.modules() if isinstance(moe, NativeMoE) for m in moe.modules()}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer) and module.is_parallel and id(module) not in held:
            raise ValueError(
                f"{name or 'the model'} is an MoELayer with ep_size={module.config.ep_size} outside a DeepSpeed MoE "
                f"module: DeepSpeed would take its experts for replicated dense weights (broadcast rank 0's experts "
                f"to every rank, average their gradients over ranks holding other experts). Under DeepSpeed build it "
                f"as moe_plugin.integrations.deepspeed.MoE (DeepSpeed's MoE signature), swap HF blocks with "
                f"swap_moe_blocks or upcycle, put a \"moe\" section in the config instead of swapping beforehand, "
                f"or use ep_size 1")


def mark_steps(engine) -> None:
    """Where a layer keeps a balancing bias or counts its balance loss globally, each optimizer step the engine
    takes (engine.step at the gradient accumulation boundary; a pipeline's train_batch) ends with
    moe_plugin.update_expert_bias (the counts cover every micro-batch) and moe_plugin.begin_step (the next step's
    global counts span its micro-batches)."""
    layers = [m for m in engine.module.modules() if isinstance(m, MoELayer)]
    bias = any(layer.config.expert_bias_update_rate > 0 for layer in layers)
    if not bias and not any(layer.config.aux_loss_scope == "global" for layer in layers):
        return
    take_model_step = engine._take_model_step

    def take_model_step_and_mark(*args, **kwargs):
        result = take_model_step(*args, **kwargs)
        if bias:
            update_expert_bias(engine.module)
        begin_step(engine.module)
        return result
    engine._take_model_step = take_model_step_and_mark
    begin_step(engine.module)


def split_client_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give a client optimizer's expert parameters groups of their own, as ZeRO 1/2 asks of MoE models (each
    group's settings kept). A scheduler built on the optimizer before would miss the new groups: refused."""
    if any("moe" in group for group in optimizer.param_groups):
        return
    groups = configure_moe_param_groups([{**group, "name": group.get("name", f"group_{i}")}
                                         for i, group in enumerate(optimizer.param_groups)])
    groups = [group for group in groups if group["params"]]
    if len(groups) != len(optimizer.param_groups) and getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        raise ValueError("the optimizer passed to initialize already has a learning-rate scheduler, built on its "
                         f"{len(optimizer.param_groups)} param groups; ZeRO stage 1/2 needs the MoE layers' expert "
                         f"parameters in groups of their own ({len(groups)} groups), which the scheduler would not "
                         "see. Build the scheduler after initialize (accelerator.prepare), or let DeepSpeed build "
                         "the optimizer (an \"optimizer\" section)")
    optimizer.param_groups[:] = groups


def _is_pipeline(model: nn.Module) -> bool:
    from deepspeed.pipe import PipelineModule
    return isinstance(model, PipelineModule)


def check_every_stage_holds_moe(model: nn.Module, has_moe: bool) -> None:
    """With a "moe" section, every stage of a PipelineModule must hold an MoE layer: each layer makes process groups
    that every process joins (torch.distributed), so a stage without one would leave the others waiting forever.
    A ValueError on every process (the stages' answers gathered first) naming the stages without one."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (int(model.stage_id), has_moe))
    lacking = sorted({stage for stage, holds in every if not holds})
    if not lacking:
        return
    if len(lacking) == model.num_stages:
        raise ValueError("the DeepSpeed config has a \"moe\" section, but no stage of the PipelineModule holds a "
                         "deepspeed.moe.layer.MoE layer: build its MoE blocks with one, or remove the \"moe\" section")
    raise ValueError(f"pipeline stage(s) {lacking} of the PipelineModule hold no MoE layer, and with a \"moe\" "
                     f"section every stage must hold one (each MoE layer makes process groups that every process "
                     f"joins): partition the layers so that each stage holds an MoE block (PipelineModule's "
                     f"partition_method=\"type:<your MoE block's class name>\", or explicit parts), or use fewer "
                     f"stages")


def count_balance_in_stage(model: nn.Module) -> None:
    """A PipelineModule's MoE layers live on one stage: aux_loss_scope "global" counts over that stage's
    data-parallel group (the processes that hold the layer, feeding it different tokens), not the world."""
    if _is_pipeline(model):
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.router.aux_loss_group = model.mpu().get_data_parallel_group()


def use_pipeline_topology(model: nn.Module) -> None:
    """A PipelineModule's MoE layers exchange tokens and reduce expert gradients inside their pipeline stage:
    DeepSpeed makes its expert groups follow the pipeline grid (groups.mpu), which its engine sets only after
    initialize has built moe_plugin's layers (and their groups). Set it first, as the engine will."""
    from deepspeed.utils import groups
    if _is_pipeline(model) and groups.mpu is None:
        groups.mpu = model.mpu()
