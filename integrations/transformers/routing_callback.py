"""HF Trainer callback RoutingMetrics (issue 44): each MoE layer's routing metrics of the logging window
(moe_plugin/routing_monitor/metrics.py) added to the Trainer's own logs as moe/<layer>/<metric> and moe/all/<metric>, so
every report_to target (TensorBoard, W&B, MLflow, the console) and trainer_state.json's log history get them; and
the routing alarm (moe_plugin/routing_monitor/alarm.py) through transformers' logger."""
from __future__ import annotations

import sys
from typing import Union

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler
from transformers.utils import logging

from moe_plugin.routing_monitor.alarm import RoutingAlarm
from moe_plugin.routing_monitor.metrics import RoutingMonitor, scalars

logger = logging.get_logger(__name__)


class RoutingMetrics(TrainerCallback):
    """Trainer(..., callbacks=[RoutingMetrics()]). alarm: True (the default thresholds), a RoutingAlarm, or False
    (none). Every process reads its window at each log (one all_reduce): the numbers are the whole run's; the
    first process warns."""

    def __init__(self, alarm: Union[bool, RoutingAlarm] = True):
        if not isinstance(alarm, (bool, RoutingAlarm)):
            raise TypeError(f"RoutingMetrics: alarm must be True, False or a moe_plugin.routing_monitor.alarm.RoutingAlarm, "
                            f"got {type(alarm).__name__}")
        self.alarm = RoutingAlarm() if alarm is True else alarm or None
        self.monitor = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _run_before_the_reporters(self)
        if self.monitor is not None:
            self.monitor.close()
        self.monitor = RoutingMonitor(model)
        if not self.monitor.layers and state.is_world_process_zero:
            logger.warning("RoutingMetrics: the model has no moe_plugin MoELayer, so no routing metrics are logged. "
                           "Swap its MoE blocks with moe_plugin.integrations.transformers.swap_moe_blocks (or "
                           "upcycle a dense model); Hugging Face's own blocks, also with experts_implementation="
                           "\"moe_plugin\" (only the experts run on moe_plugin), route with HF's router, which this "
                           "callback does not see")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.monitor is None or logs is None or any(key.startswith("eval_") for key in logs):
            return      # an evaluation's log: the training window goes on to the next training log
        metrics = self.monitor.read()
        tags = scalars(metrics)
        logs.update(tags)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(tags)
        messages = self.alarm.check(metrics) if self.alarm is not None and metrics else []
        for message in messages if state.is_world_process_zero else []:     # every process read the same sums
            logger.warning(message)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


def _run_before_the_reporters(callback: TrainerCallback) -> None:
    """Moves callback to the front of the Trainer's CallbackHandler (the one calling it now): Trainer puts the
    user's callbacks after its report_to ones, which would have written each log before this adds to it."""
    frame = sys._getframe(1)
    while frame is not None:
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler) and callback in handler.callbacks:
            handler.callbacks.remove(callback)
            handler.callbacks.insert(0, callback)
            return
        frame = frame.f_back
    raise RuntimeError("RoutingMetrics: not called by a transformers CallbackHandler; pass it to "
                       "Trainer(callbacks=[RoutingMetrics()]) or trainer.add_callback")
