"""Routing metrics under DeepSpeed (issue 44): the engine's optimizer step (engine.step() at a boundary, or
engine.train_batch() under pipeline parallelism) reads each MoE layer's routing window every steps_per_print
optimizer steps (10 without it; moe_plugin/routing_monitor/metrics.py) and writes moe/<layer>/<metric>
and moe/all/<metric> to the engine's monitor (the tensorboard, wandb, csv_monitor and comet sections of the
DeepSpeed JSON), at DeepSpeed's own x-axis (samples seen); the routing alarm (the "moe" section's routing_alarm)
warns through DeepSpeed's logger, on rank 0 (every rank reads the same sums)."""
from __future__ import annotations

import logging
from typing import Any, Mapping, Union

import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import log_dist

from moe_plugin import MoELayer
from moe_plugin.routing_monitor.alarm import RoutingAlarm
from moe_plugin.routing_monitor.metrics import RoutingMonitor, scalars

ALARM_KEYS = ("min_share", "max_dropped", "windows", "max_rank_load")
EVERY_WITHOUT_PRINTS = 10      # the window, in optimizer steps, of a config without steps_per_print (DeepSpeed's None)


def routing_alarm(setting: Union[bool, Mapping[str, Any]]):
    """The "moe.routing_alarm" setting (true: the default thresholds; false: none; an object of ALARM_KEYS) as a
    RoutingAlarm or None. ValueError naming the setting when it is none of these."""
    allowed = f"true, false or an object with some of {', '.join(ALARM_KEYS)}"
    if isinstance(setting, bool):
        return RoutingAlarm() if setting else None
    if not isinstance(setting, Mapping) or any(key not in ALARM_KEYS for key in setting):
        raise ValueError(f"DeepSpeed config \"moe.routing_alarm\"={setting!r} is invalid: must be {allowed}")
    try:
        return RoutingAlarm(**setting)
    except ValueError as error:
        raise ValueError(f"DeepSpeed config \"moe.routing_alarm\": {error}") from None


def log_routing(engine, alarm) -> None:
    """Wraps the engine's optimizer step (engine._take_model_step: engine.step's at each gradient accumulation
    boundary, and engine.train_batch's under pipeline parallelism) so that at every steps_per_print-th optimizer
    step (EVERY_WITHOUT_PRINTS-th without it) every process reads the window (one all_reduce over the processes
    holding its layers) and rank 0 writes it to the monitor (when the config enables one); the alarm's warnings go
    to DeepSpeed's logger on rank 0. Under pipeline parallelism each stage reads its own layers over its
    data-parallel group, and the stages' metrics are gathered (stages without an MoE layer add none)."""
    if not engine.monitor.enabled and alarm is None:
        return
    pipeline = isinstance(engine, PipelineEngine)
    local = any(isinstance(m, MoELayer) for m in engine.module.modules())
    held = [local]
    if pipeline:      # a stage may hold no MoE layer while others do: every stage then takes part
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, local)
    if not any(held):
        return
    monitor = RoutingMonitor(engine.module)
    group = engine.grid.get_data_parallel_group() if pipeline else None
    take = engine._take_model_step
    every = engine.steps_per_print() or EVERY_WITHOUT_PRINTS

    def take_and_log(*args, **kwargs):
        result = take(*args, **kwargs)
        if engine.global_steps % every == 0:
            metrics = monitor.read(group)
            if pipeline:      # each stage's layers (names unique over the stages: the pipeline's layer numbers)
                stages = [None] * dist.get_world_size()
                dist.all_gather_object(stages, metrics)
                metrics = {name: stage[name] for stage in stages for name in sorted(stage)}
            if engine.monitor.enabled:
                engine.monitor.write_events([(tag, value, engine.global_samples)
                                             for tag, value in scalars(metrics).items()])
            for message in alarm.check(metrics) if alarm is not None else []:
                log_dist(message, ranks=[0], level=logging.WARNING)
        return result
    engine._take_model_step = take_and_log
