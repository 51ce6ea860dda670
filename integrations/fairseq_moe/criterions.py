"""moe_cross_entropy and moe_label_smoothed_cross_entropy: the task loss plus the weighted MoE gate loss.

loss = task loss + --moe-gate-loss-wt * gate loss * sample_size, where the gate loss is the average
(or sum, --moe-gate-loss-combine-method) of the MoE layers' load-balancing losses of this forward.
The factor sample_size undoes the trainer's division by it, as fairseq's MoE branch does.

Logged besides the task metrics: moe_gate_loss, moe_dropped (fraction of token choices dropped
over capacity) and moe_share_e<i> (share of the token choices routed to expert i, summed over
the MoE layers; 1/E each when balanced). The reported loss and perplexity are the task's alone.
"""

from dataclasses import dataclass, field

import torch
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (LabelSmoothedCrossEntropyCriterion,
                                                             LabelSmoothedCrossEntropyCriterionConfig)
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics

from moe_plugin import MoELayer

from .registration import criterion

COMBINE_METHODS = ChoiceEnum(["average", "sum"])
MAX_LOGGED_EXPERTS = 16   # beyond this, only the largest and smallest share are logged


@dataclass
class MoEGateLossConfig(FairseqDataclass):
    moe_gate_loss_wt: float = field(default=0.01, metadata={"help": "weight of the MoE load-balancing loss"})
    moe_gate_loss_combine_method: COMBINE_METHODS = field(default="average", metadata={
        "help": "how the layers' gate losses combine: average or sum"})


@dataclass
class MoECrossEntropyConfig(CrossEntropyCriterionConfig, MoEGateLossConfig):
    pass


@dataclass
class MoELabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig, MoEGateLossConfig):
    pass


class GateLoss:
    def __init__(self, weight: float, combine: str):
        if not weight >= 0:
            raise ValueError(f"--moe-gate-loss-wt {weight!r} is invalid: must be a number >= 0")
        if combine not in ("average", "sum"):
            raise ValueError(f"--moe-gate-loss-combine-method {combine!r} is invalid: allowed: 'average', 'sum'")
        self.weight, self.combine = weight, str(combine)

    def add(self, loss: torch.Tensor, model: torch.nn.Module, sample_size, logging_output: dict) -> torch.Tensor:
        """loss + the weighted gate loss; the MoE statistics go into logging_output."""
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        if not layers:
            return loss
        gate_loss = sum(layer.aux_loss for layer in layers)
        if self.combine == "average":
            gate_loss = gate_loss / len(layers)
        tokens_E = torch.tensor([layer.stats["tokens_per_expert"] for layer in layers], dtype=torch.float64).sum(0)
        choices = float(tokens_E.sum())
        dropped = sum(layer.stats["dropped_fraction"] * sum(layer.stats["tokens_per_expert"]) for layer in layers)
        logging_output["moe_gate_loss"] = float(gate_loss.detach()) * sample_size
        logging_output["moe_choices"] = choices
        logging_output["moe_dropped"] = dropped
        for e, tokens in enumerate(tokens_E.tolist()):
            logging_output[f"moe_tokens_e{e}"] = tokens
        return loss + self.weight * gate_loss * sample_size


def reduce_moe_metrics(logging_outputs) -> None:
    if not any("moe_choices" in log for log in logging_outputs):
        return
    total = lambda key: sum(log.get(key, 0) for log in logging_outputs)   # noqa: E731
    sample_size, choices = total("sample_size"), total("moe_choices")
    metrics.log_scalar("moe_gate_loss", total("moe_gate_loss") / max(sample_size, 1), sample_size, round=4)
    metrics.log_scalar("moe_dropped", total("moe_dropped") / max(choices, 1), choices, round=4)
    experts = sum(1 for key in logging_outputs[0] if key.startswith("moe_tokens_e"))
    shares = [total(f"moe_tokens_e{e}") / max(choices, 1) for e in range(experts)]
    if experts <= MAX_LOGGED_EXPERTS:
        for e, share in enumerate(shares):
            metrics.log_scalar(f"moe_share_e{e}", share, choices, round=4)
    else:
        metrics.log_scalar("moe_share_max", max(shares), choices, round=4)
        metrics.log_scalar("moe_share_min", min(shares), choices, round=4)


@criterion("moe_cross_entropy", dataclass=MoECrossEntropyConfig)
class MoECrossEntropyCriterion(CrossEntropyCriterion):
    def __init__(self, task, sentence_avg, moe_gate_loss_wt=0.01, moe_gate_loss_combine_method="average"):
        super().__init__(task, sentence_avg)
        self.gate_loss = GateLoss(moe_gate_loss_wt, moe_gate_loss_combine_method)

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        return self.gate_loss.add(loss, model, sample_size, logging_output), sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        CrossEntropyCriterion.reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)


@criterion("moe_label_smoothed_cross_entropy", dataclass=MoELabelSmoothedCrossEntropyConfig)
class MoELabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 moe_gate_loss_wt=0.01, moe_gate_loss_combine_method="average"):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.gate_loss = GateLoss(moe_gate_loss_wt, moe_gate_loss_combine_method)

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        return self.gate_loss.add(loss, model, sample_size, logging_output), sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)
