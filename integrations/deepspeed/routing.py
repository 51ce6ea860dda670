"""Routing metrics under DeepSpeed (issue 44): engine.step() reads each MoE layer's routing window every
steps_per_print optimizer steps (10 without it; moe_plugin/routing_metrics.py) and writes moe/<layer>/<metric>
and moe/all/<metric> to the engine's monitor (the tensorboard, wandb, csv_monitor and comet sections of the
DeepSpeed JSON), at DeepSpeed's own x-axis (samples seen); the routing alarm (the "moe" section's routing_alarm)
warns through DeepSpeed's logger, on rank 0 (every rank reads the same sums)."""
from __future__ import annotations

import logging
from typing import Any, Mapping, Union

from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import log_dist

from moe_plugin import MoELayer
from moe_plugin.routing_alarm import RoutingAlarm
from moe_plugin.routing_metrics import RoutingMonitor, scalars

ALARM_KEYS = ("min_share", "max_dropped", "windows")
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
    """Wraps engine.step so that at every steps_per_print-th optimizer step (EVERY_WITHOUT_PRINTS-th without it)
    every process reads the window (one all_reduce) and rank 0 writes it to the monitor (when the config enables
    one); the alarm's warnings go to DeepSpeed's logger on rank 0."""
    if not any(isinstance(m, MoELayer) for m in engine.module.modules()):
        return
    if not engine.monitor.enabled and alarm is None:
        return
    if isinstance(engine, PipelineEngine):    # train_batch steps without engine.step; its stages hold other layers
        log_dist("moe_plugin: the routing metrics and the routing alarm do not run under pipeline parallelism "
                 "(engine.train_batch) yet: nothing of them is logged", ranks=[0], level=logging.WARNING)
        return
    monitor = RoutingMonitor(engine.module)
    step = engine.step
    every = engine.steps_per_print() or EVERY_WITHOUT_PRINTS

    def step_and_log(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()
        result = step(*args, **kwargs)
        if boundary and engine.global_steps % every == 0:
            metrics = monitor.read()
            if engine.monitor.enabled:
                engine.monitor.write_events([(tag, value, engine.global_samples)
                                             for tag, value in scalars(metrics).items()])
            for message in alarm.check(metrics) if alarm is not None else []:
                log_dist(message, ranks=[0], level=logging.WARNING)
        return result
    engine.step = step_and_log
