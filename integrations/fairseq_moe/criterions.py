"""moe_cross_entropy and moe_label_smoothed_cross_entropy: the task loss plus the weighted MoE gate loss.

loss = task loss + --moe-gate-loss-wt * gate loss * sample_size, where the gate loss is the average
(or sum, --moe-gate-loss-combine-method) of the MoE layers' load-balancing losses of this forward.
The factor sample_size undoes the trainer's division by it, as fairseq's MoE branch does.

Logged besides the task metrics: moe_gate_loss, moe_dropped (fraction of token choices dropped
over capacity) and moe_share_e<i> (share of the token choices routed to expert i, summed over
the MoE layers; 1/E each when balanced); and per MoE layer moe/<layer>/<metric> with the summary
moe/all/<metric> (moe_plugin/routing_monitor/metrics.py), from the window sums of each training forward, summed by
fairseq over micro-batches, processes and the log interval (hidden meters _moe/...). The reported loss and
perplexity are the task's alone.

The routing alarm (--moe-routing-alarm-*, --no-moe-routing-alarm; config.py) checks each log interval's
per-layer metrics when fairseq-train reads them for its log line, warns through Python's logging on the master
process, and shows as moe/alarm_layers: the MoE layers in alarm now.
"""
import logging

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (LabelSmoothedCrossEntropyCriterion,
                                                             LabelSmoothedCrossEntropyCriterionConfig)
from fairseq.dataclass import ChoiceEnum
from fairseq.logging import metrics

from moe_plugin import MoELayer
from moe_plugin.routing_monitor.metrics import VECTOR_SUMS, RoutingMonitor, metrics_from_sums, scalars

from .config import RoutingAlarmArgs, flag_errors, routing_alarm_from_args
from .registration import criterion

logger = logging.getLogger(__name__)

COMBINE_METHODS = ChoiceEnum(["average", "sum"])
MAX_LOGGED_EXPERTS = 16   # beyond this, only the largest and smallest share are logged
ALARM_TAG = "moe/alarm_layers"
LOG_INTERVAL_METERS = "train_inner"     # fairseq_cli/train.py's meters of one --log-interval, read once per interval


@dataclass
class MoEGateLossConfig(RoutingAlarmArgs):
    moe_gate_loss_wt: float = field(default=0.01, metadata={"help": "weight of the MoE load-balancing loss"})
    moe_gate_loss_combine_method: COMBINE_METHODS = field(default="average", metadata={
        "help": "how the layers' gate losses combine: average or sum"})


@dataclass
class MoECrossEntropyConfig(CrossEntropyCriterionConfig, MoEGateLossConfig):
    pass


@dataclass
class MoELabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, MoEGateLossConfig):
    pass


def check_gate_loss_flags(args) -> None:
    """The MoE criterions' flags (--moe-gate-loss-*, --moe-routing-alarm-*) in fairseq-train's parsed args, checked
    as the criterions will check them: the archs run this as fairseq-train parses the flags."""
    GateLoss(args.moe_gate_loss_wt, args.moe_gate_loss_combine_method, routing_alarm_from_args(
        args.moe_routing_alarm_min_share, args.moe_routing_alarm_max_dropped, args.moe_routing_alarm_windows,
        args.no_moe_routing_alarm, getattr(args, "moe_routing_alarm_max_rank_load", None)))


class GateLoss:
    def __init__(self, weight: float, combine: str, alarm=None):
        """alarm: a RoutingAlarm checked at each log interval (routing_alarm_from_args), or None."""
        if not weight >= 0:
            raise ValueError(f"--moe-gate-loss-wt {weight!r} is invalid: must be a number >= 0")
        if combine not in ("average", "sum"):
            raise ValueError(f"--moe-gate-loss-combine-method {combine!r} is invalid: allowed: 'average', 'sum'")
        self.weight, self.combine = weight, str(combine)
        self.monitor, self.watched = None, None
        self.alarm = alarm

    def watch(self, model: torch.nn.Module) -> None:
        """Routing metrics of model's MoE layers from its next forward on (call before it; unwraps fairseq's
        distributed wrappers, so that layer names are the model's own)."""
        while isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        if self.watched is not model:
            if self.monitor is not None:
                self.monitor.close()
            self.monitor, self.watched = RoutingMonitor(model), model
        if self.alarm is not None and model.training:
            metrics.log_derived(ALARM_TAG, self.layers_in_alarm)      # once per aggregator: a lookup after that

    def layers_in_alarm(self, meters) -> float:
        """The derived meter moe/alarm_layers. Read from the log interval's meters (as fairseq-train does once
        per interval), it first checks that interval's per-layer metrics with the alarm and logs its warnings."""
        if meters is metrics.get_meters(LOG_INTERVAL_METERS):
            hidden = [key for key in meters.keys() if key.startswith("_moe/")]
            layers = window_sums(lambda key: meters[key].sum, hidden)
            messages = self.alarm.check({name: metrics_from_sums(sums) for name, sums in layers.items()
                                         if sums.get("forwards", 0) > 0})
            if not dist.is_initialized() or dist.get_rank() == 0:    # every process holds the same sums
                for message in messages:
                    logger.warning(message)
        return float(self.alarm.layers_in_alarm())

    def add(self, loss: torch.Tensor, model: torch.nn.Module, sample_size, logging_output: dict) -> torch.Tensor:
        """loss + the weighted gate loss; the MoE statistics go into logging_output: in training as device tensors
        (the monitor's sums of this forward; fairseq sums them and reduce_metrics reads them once per update), in
        evaluation from the layers' stats."""
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        if not layers:
            return loss
        gate_loss = sum(layer.aux_loss for layer in layers)
        if self.combine == "average":
            gate_loss = gate_loss / len(layers)
        taken = self.monitor.take_sums() if self.monitor is not None and model.training else {}
        if taken:
            tokens_E = torch.stack([sums["load"] for sums in taken.values()]).sum(0)
            choices = sum(sums["choices"] for sums in taken.values())
            dropped = choices - sum(sums["kept"].sum() for sums in taken.values())
            logging_output.update(routing_sums(taken))
        else:
            stats = [layer.stats for layer in layers]
            tokens_E = torch.tensor([s["tokens_per_expert"] for s in stats], dtype=torch.float64).sum(0)
            choices = float(tokens_E.sum())
            dropped = sum(s["dropped_fraction"] * sum(s["tokens_per_expert"]) for s in stats)
        logging_output["moe_gate_loss"] = gate_loss.detach() * sample_size
        logging_output["moe_choices"] = choices
        logging_output["moe_dropped"] = dropped
        for e, tokens in enumerate(tokens_E):
            logging_output[f"moe_tokens_e{e}"] = tokens
        return loss + self.weight * gate_loss * sample_size


def routing_sums(taken: dict) -> dict:
    """RoutingMonitor.take_sums() as flat logging-output keys _moe/<layer>/<sum> (the items of load and kept as
    <sum>_<i>)."""
    flat = {}
    for name, sums in taken.items():
        for key, value in sums.items():
            items = enumerate(value) if torch.is_tensor(value) and value.dim() == 1 else [(None, value)]
            flat.update({f"_moe/{name}/{key}" + ("" if i is None else f"_{i}"): v for i, v in items})
    return flat


def totals(logging_outputs, keys) -> dict:
    """{key: its sum over the logging outputs, a float}; the device tensors among them read in one transfer."""
    sums = [sum(log.get(key, 0) for log in logging_outputs) for key in keys]
    tensors = [value for value in sums if torch.is_tensor(value)]
    read = iter(torch.stack([t.to(tensors[0].device, torch.float64) for t in tensors]).tolist() if tensors else [])
    return {key: next(read) if torch.is_tensor(value) else float(value) for key, value in zip(keys, sums)}


def window_sums(sum_of, names) -> dict:
    """{layer: sums} back from the _moe/ keys' sums (sum_of(key)) for metrics_from_sums."""
    layers = {}
    for key in names:
        _, name, entry = key.split("/")
        base, _, index = entry.rpartition("_")
        sums = layers.setdefault(name, {part: {} for part in VECTOR_SUMS})
        if base in VECTOR_SUMS and index.isdigit():
            sums[base][int(index)] = sum_of(key)
        else:
            sums[entry] = sum_of(key)
    for sums in layers.values():
        for part in VECTOR_SUMS:
            sums[part] = [sums[part][i] for i in sorted(sums[part])]
    return layers


def reduce_routing_metrics(logging_outputs) -> None:
    """Each _moe/ key summed into a hidden sum meter; moe/<layer>/<metric> and moe/all/<metric> derived from the
    meters' sums over the aggregation (fairseq's log interval, epoch)."""
    names = sorted({key for log in logging_outputs for key in log if key.startswith("_moe/")})
    total = totals(logging_outputs, names)
    for key in names:
        metrics.log_scalar_sum(key, total[key])

    def derived(tag):
        def value(meters):
            hidden = [key for key in meters.keys() if key.startswith("_moe/")]
            layers = window_sums(lambda key: meters[key].sum, hidden)
            return scalars({name: metrics_from_sums(sums) for name, sums in layers.items()})[tag]
        return value
    tags = scalars({name: metrics_from_sums(sums) for name, sums in window_sums(total.get, names).items()})
    for tag in tags:
        metrics.log_derived(tag, derived(tag))


def reduce_moe_metrics(logging_outputs) -> None:
    reduce_routing_metrics(logging_outputs)
    if not any("moe_choices" in log for log in logging_outputs):
        return
    experts = sum(1 for key in logging_outputs[0] if key.startswith("moe_tokens_e"))
    total = totals(logging_outputs, ["sample_size", "moe_choices", "moe_gate_loss", "moe_dropped"] +
                   [f"moe_tokens_e{e}" for e in range(experts)])
    sample_size, choices = total["sample_size"], total["moe_choices"]
    metrics.log_scalar("moe_gate_loss", total["moe_gate_loss"] / max(sample_size, 1), sample_size, round=4)
    metrics.log_scalar("moe_dropped", total["moe_dropped"] / max(choices, 1), choices, round=4)
    shares = [total[f"moe_tokens_e{e}"] / max(choices, 1) for e in range(experts)]
    if experts <= MAX_LOGGED_EXPERTS:
        for e, share in enumerate(shares):
            metrics.log_scalar(f"moe_share_e{e}", share, choices, round=4)
    else:
        metrics.log_scalar("moe_share_max", max(shares), choices, round=4)
        metrics.log_scalar("moe_share_min", min(shares), choices, round=4)


@criterion("moe_cross_entropy", dataclass=MoECrossEntropyConfig)
class MoECrossEntropyCriterion(CrossEntropyCriterion):
    def __init__(self, task, sentence_avg, moe_gate_loss_wt=0.01, moe_gate_loss_combine_method="average",
                 moe_routing_alarm_min_share=0.1, moe_routing_alarm_max_dropped=0.2, moe_routing_alarm_windows=3,
                 no_moe_routing_alarm=False, moe_routing_alarm_max_rank_load=None):
        super().__init__(task, sentence_avg)
        with flag_errors():
            self.gate_loss = GateLoss(moe_gate_loss_wt, moe_gate_loss_combine_method, routing_alarm_from_args(
                moe_routing_alarm_min_share, moe_routing_alarm_max_dropped, moe_routing_alarm_windows,
                no_moe_routing_alarm, moe_routing_alarm_max_rank_load))

    def forward(self, model, sample, reduce=True):
        self.gate_loss.watch(model)
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        return self.gate_loss.add(loss, model, sample_size, logging_output), sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        CrossEntropyCriterion.reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)


@criterion("moe_label_smoothed_cross_entropy", dataclass=MoELabelSmoothedCrossEntropyConfig)
class MoELabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 moe_gate_loss_wt=0.01, moe_gate_loss_combine_method="average",
                 moe_routing_alarm_min_share=0.1, moe_routing_alarm_max_dropped=0.2, moe_routing_alarm_windows=3,
                 no_moe_routing_alarm=False, moe_routing_alarm_max_rank_load=None):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        with flag_errors():
            self.gate_loss = GateLoss(moe_gate_loss_wt, moe_gate_loss_combine_method, routing_alarm_from_args(
                moe_routing_alarm_min_share, moe_routing_alarm_max_dropped, moe_routing_alarm_windows,
                no_moe_routing_alarm, moe_routing_alarm_max_rank_load))

    def forward(self, model, sample, reduce=True):
        self.gate_loss.watch(model)
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        return self.gate_loss.add(loss, model, sample_size, logging_output), sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)
