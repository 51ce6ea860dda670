"""fairseq arguments -> one MoEConfig.

The flags keep the names of fairseq's MoE branch where it has one (--moe-expert-count, --moe-freq,
--moe-gating-use-fp32, --moe-second-expert-policy, --moe-normalize-gate-prob-before-dropping,
--moe-batch-prioritized-routing, --moe-expert-ffn-dim, --moe-eval-capacity-token-fraction) and with
their semantics there; the rest map one to one onto MoEConfig fields. All checking of values is the
core's (MoEConfig, check_sizes); this module only renames, and names the flag in the error. Inside a
fairseq command such an error ends it as argparse's own errors do (flag_errors).
"""

import contextlib
import os
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.utils import safe_getattr

from moe_plugin import MoEConfig
from moe_plugin.parallel.groups import check_sizes
from moe_plugin.routing_monitor.alarm import RoutingAlarm


@dataclass
class MoEArgs(FairseqDataclass):
    moe_expert_count: int = field(default=8, metadata={"help": "experts per MoE layer (in total, over all ranks)"})
    moe_freq: int = field(default=2, metadata={
        "help": "every N-th transformer layer (N, 2N, ...) has an MoE FFN; 1: every layer"})
    moe_top_k: int = field(default=2, metadata={"help": "experts per token"})
    moe_capacity_factor: float = field(default=1.0, metadata={
        "help": "> 0: capacity per expert max(ceil(k * cf * tokens / experts), 4); 0: dropless; "
                "< 0: the largest real load, capped at |cf| times the fixed capacity"})
    moe_eval_capacity_token_fraction: float = field(default=0.25, metadata={
        "help": "in eval mode each expert takes up to this fraction of the tokens; <= 0: as in training"})
    moe_expert_ffn_dim: Optional[int] = field(default=None, metadata={
        "help": "hidden size of each expert (default: the layer's --encoder/decoder-ffn-embed-dim)"})
    moe_gating_use_fp32: bool = field(default=False, metadata={"help": "compute the router in fp32"})
    moe_second_expert_policy: str = field(default="all", metadata={
        "help": "only 'all' (every token goes to its k best experts); fairseq's 'sampling' and 'random' "
                "are not supported"})
    moe_normalize_gate_prob_before_dropping: bool = field(default=False, metadata={
        "help": "renormalize the k gates before dropping tokens over capacity (default: after)"})
    moe_batch_prioritized_routing: bool = field(default=False, metadata={
        "help": "tokens with the highest router score claim expert slots first"})
    moe_router: str = field(default="softmax", metadata={"help": "softmax, sigmoid or cosine"})
    moe_ep_size: int = field(default=1, metadata={
        "help": "ranks the experts are spread over (consecutive blocks of the world); 1: every rank "
                "holds every expert"})
    moe_parallel: str = field(default="1", metadata={
        "help": "0: gather the experts, 1: expert parallel, r > 1: each expert sliced over r ranks, "
                "auto (re-tuned per load) or auto_once (tuned once)"})
    moe_overlap_degree: str = field(default="1", metadata={
        "help": "chunks the all-to-all is cut into to overlap it with expert compute, auto or auto_once"})
    moe_a2a: str = field(default="flat", metadata={"help": "flat, 2dh (2D-hierarchical all-to-all) or auto (with --moe-parallel auto)"})
    moe_aux_loss: str = field(default="gshard", metadata={
        "help": "load-balancing loss: gshard (first choices), switch (all k choices), seq (DeepSeek-V3's "
                "per-sequence loss) or none"})
    moe_aux_loss_scope: str = field(default="local", metadata={
        "help": "local: the balance loss counts each process's tokens; global: every process's (all-reduced), so "
                "that the router's gradient is one process's on the whole batch (small batches per process)"})
    moe_redundant_experts: str = field(default="0", metadata={
        "help": "up to this many extra copies of the hottest experts on the least-loaded expert-parallel ranks, "
                "re-planned every forward, or auto (the copies the cost model finds worth their traffic); the math "
                "is unchanged (needs --moe-ep-size > 1)"})
    moe_expert_bias_update_rate: float = field(default=0.0, metadata={
        "help": "> 0: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the choice scores, "
                "moved by this much per update towards the under-loaded experts"})
    moe_num_groups: int = field(default=1, metadata={
        "help": "group-limited routing: the experts form this many groups of consecutive experts"})
    moe_topk_groups: int = field(default=1, metadata={
        "help": "each token chooses only inside its this many best groups"})
    moe_route_scale: float = field(default=1.0, metadata={"help": "multiplies the final gates (> 0)"})
    moe_shared_hidden_size: int = field(default=0, metadata={
        "help": "> 0: a shared expert FFN of this width applied to every token, added to the MoE output"})
    moe_shared_gate: bool = field(default=False, metadata={
        "help": "multiply the shared expert's output per token by sigmoid(x . w) (Qwen2-MoE)"})
    moe_recompute: str = field(default="none", metadata={
        "help": "what the experts keep for backward: none (their first projection's output) or experts (only the "
                "layer's input and routing; backward runs the first projection again)"})


@dataclass
class RoutingAlarmArgs(FairseqDataclass):
    """The MoE criterions' routing alarm (moe_plugin/routing_monitor/alarm.py), checked at each --log-interval."""
    moe_routing_alarm_min_share: float = field(default=0.1, metadata={
        "help": "routing alarm: an expert under this share of the mean load is starved (in [0, 1))"})
    moe_routing_alarm_max_dropped: float = field(default=0.2, metadata={
        "help": "routing alarm: a dropped fraction over this is too high (in [0, 1))"})
    moe_routing_alarm_windows: int = field(default=3, metadata={
        "help": "routing alarm: warn once a layer has been starved or dropping for this many log intervals in a row"})
    no_moe_routing_alarm: bool = field(default=False, metadata={"help": "turn the routing alarm off"})
    moe_routing_alarm_max_rank_load: Optional[float] = field(default=None, metadata={
        "help": "routing alarm: warn when the busiest expert-parallel rank computes over this many times the mean "
                "rank's routed rows (>= 1; default: not watched)"})


ALARM_FLAGS = {"min_share": "--moe-routing-alarm-min-share", "max_dropped": "--moe-routing-alarm-max-dropped",
               "windows": "--moe-routing-alarm-windows", "max_rank_load": "--moe-routing-alarm-max-rank-load"}


def routing_alarm_from_args(min_share: Any, max_dropped: Any, windows: Any, off: bool,
                            max_rank_load: Any = None) -> Optional[RoutingAlarm]:
    """The RoutingAlarm of the --moe-routing-alarm-* flags, None with --no-moe-routing-alarm. ValueError names
    the flag and the value given."""
    if off:
        return None
    values = {"min_share": min_share, "max_dropped": max_dropped, "windows": windows, "max_rank_load": max_rank_load}
    try:
        return RoutingAlarm(**values)
    except ValueError as error:
        key = next(key for key in ALARM_FLAGS if f" {key} " in str(error))
        raise ValueError(f"{ALARM_FLAGS[key]} {values[key]!r} is invalid: {error}") from None


SECOND_EXPERT_POLICIES = ("all",)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "linear": "identity"}   # fairseq --activation-fn -> MoEConfig
FLAG_OF_FIELD = {
    "num_experts": "--moe-expert-count", "top_k": "--moe-top-k", "capacity_factor": "--moe-capacity-factor",
    "eval_capacity_factor": "--moe-eval-capacity-token-fraction", "hidden_size": "--moe-expert-ffn-dim",
    "router": "--moe-router", "ep_size": "--moe-ep-size", "parallel": "--moe-parallel",
    "overlap_degree": "--moe-overlap-degree", "a2a": "--moe-a2a", "activation": "--activation-fn",
    "aux_loss": "--moe-aux-loss", "aux_loss_scope": "--moe-aux-loss-scope", "expert_bias_update_rate": "--moe-expert-bias-update-rate",
    "num_groups": "--moe-num-groups", "topk_groups": "--moe-topk-groups", "route_scale": "--moe-route-scale",
    "shared_hidden_size": "--moe-shared-hidden-size", "shared_gate": "--moe-shared-gate",
    "recompute": "--moe-recompute", "redundant_experts": "--moe-redundant-experts",
}


@contextlib.contextmanager
def flag_errors():
    """with flag_errors(): checks of the flags. Inside a fairseq command (fairseq-train, python -m fairseq_cli.train,
    ...) a ValueError from them ends the command as argparse's own errors do: one line `prog: error: message` on
    stderr, exit status 2, no traceback. Called from Python (tests, a script building a model), the ValueError
    stays."""
    try:
        yield
    except ValueError as error:
        if not in_fairseq_command():
            raise
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def in_fairseq_command() -> bool:
    """Whether this process runs one of fairseq's commands: the console scripts fairseq-* (also under torchrun),
    or python -m fairseq_cli.*."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (getattr(spec, "name", None) or "").startswith("fairseq_cli.") or \
        os.path.basename(sys.argv[0] if sys.argv else "").startswith("fairseq-")


def add_moe_args(parser) -> None:
    """Add the --moe-* flags (no defaults: the arch functions fill them in, see set_moe_defaults)."""
    gen_parser_from_dataclass(parser, MoEArgs(), delete_default=True)


def set_moe_defaults(args) -> None:
    """Give every --moe-* flag the user did not set its default (args: Namespace or DictConfig)."""
    for f in fields(MoEArgs):
        if safe_getattr(args, f.name, None) is None:
            setattr(args, f.name, f.default)


def moe_config_from_args(args, model_dim: int, ffn_dim: int) -> MoEConfig:
    """The MoEConfig of one MoE layer of width model_dim whose dense FFN would be ffn_dim wide.

    ValueError names the flag, the value given and what is allowed.
    """
    policy = safe_getattr(args, "moe_second_expert_policy", "all")
    if policy not in SECOND_EXPERT_POLICIES:
        raise ValueError(
            f"--moe-second-expert-policy {policy!r} is not supported: moe_plugin sends every token to its "
            f"--moe-top-k best experts, which is fairseq's policy 'all'; allowed: 'all' "
            f"('sampling' and 'random' are not supported)")
    activation = safe_getattr(args, "activation_fn", "relu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"--activation-fn {activation!r} is not supported in MoE layers; "
                         f"allowed: {', '.join(repr(a) for a in ACTIVATIONS)}")
    num_experts, top_k = args.moe_expert_count, args.moe_top_k
    fraction = args.moe_eval_capacity_token_fraction
    values = dict(
        model_dim=model_dim,
        hidden_size=ffn_dim if args.moe_expert_ffn_dim is None else args.moe_expert_ffn_dim,
        num_experts=num_experts,
        top_k=top_k,
        capacity_factor=args.moe_capacity_factor,
        # fairseq: eval capacity = fraction * tokens; here capacity = k * cf * tokens / experts
        eval_capacity_factor=None if _number(fraction) and fraction <= 0 else _ratio(fraction, num_experts, top_k),
        router=args.moe_router,
        fp32_router=bool(args.moe_gating_use_fp32),
        # fairseq's top-1 gate is the expert's probability; its top-2 gates are renormalized
        normalize_gate="none" if top_k == 1 else
        "before_drop" if args.moe_normalize_gate_prob_before_dropping else "after_drop",
        batch_prioritized_routing=bool(args.moe_batch_prioritized_routing),
        aux_loss=args.moe_aux_loss,
        aux_loss_scope=getattr(args, "moe_aux_loss_scope", "local"),   # checkpoints' args from before the flag
        redundant_experts=_replicas(getattr(args, "moe_redundant_experts", 0)),
        aux_loss_coef=1.0,   # the criterion weighs it (--moe-gate-loss-wt)
        activation=ACTIVATIONS[activation],
        ep_size=args.moe_ep_size,
        parallel=_int_or_auto("--moe-parallel", args.moe_parallel),
        overlap_degree=_int_or_auto("--moe-overlap-degree", args.moe_overlap_degree),
        a2a=args.moe_a2a,
        expert_bias_update_rate=args.moe_expert_bias_update_rate,
        num_groups=args.moe_num_groups,
        topk_groups=args.moe_topk_groups,
        route_scale=args.moe_route_scale,
        shared_hidden_size=args.moe_shared_hidden_size,
        shared_gate=args.moe_shared_gate,
        recompute=args.moe_recompute,
    )
    try:
        config = MoEConfig(**values)
        check_sizes(config.num_experts, config.hidden_size, config.ep_size)
    except ValueError as error:
        raise ValueError(f"{_flag_of(str(error))}: {error}") from error
    return config


def single_process_error(ep_size: int) -> str:
    return (f"--moe-ep-size {ep_size} needs a distributed run of at least that many processes "
            f"(--distributed-world-size); this one is a single process")


def moe_layer_indices(args, num_layers: int, where: str) -> list:
    """Indices of the layers (of num_layers) that get an MoE FFN: every --moe-freq-th one."""
    freq = args.moe_freq
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ValueError(f"--moe-freq {freq!r} is invalid: must be an integer >= 1 (1: every layer is MoE)")
    indices = list(range(freq - 1, num_layers, freq))
    if not indices:
        raise ValueError(f"--moe-freq {freq} with --{where}-layers {num_layers} gives no MoE layer; "
                         f"use --moe-freq between 1 and {num_layers}")
    return indices


def _flag_of(message: str) -> str:
    match = re.search(r"MoEConfig\.(\w+)=", message) or re.match(r"(ep_size)=", message)
    name = match.group(1) if match else None
    return FLAG_OF_FIELD.get(name, "invalid --moe-* flags")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ratio(fraction: Any, num_experts: Any, top_k: Any) -> Any:
    """fraction * E / k when all are numbers, else the fraction itself (MoEConfig then says what is wrong)."""
    if _number(fraction) and _number(num_experts) and _number(top_k) and top_k > 0:
        return fraction * num_experts / top_k
    return fraction


def _replicas(value: Union[int, str]) -> Union[int, str]:
    """--moe-redundant-experts: an integer or "auto" (MoEConfig checks the integer)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if value == "auto" or isinstance(value, int):
        return value
    raise ValueError(f"--moe-redundant-experts {value!r} is invalid: must be an integer >= 0 or 'auto'")


def _int_or_auto(flag: str, value: Union[int, str]) -> Union[int, str]:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if value in ("auto", "auto_once"):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ValueError(f"{flag} {value!r} is invalid: must be an integer >= 0, 'auto' or 'auto_once'")
