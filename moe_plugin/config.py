"""MoEConfig: every knob of an MoE layer, once, validated on construction."""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

ROUTERS = ("softmax", "sigmoid", "cosine", "sqrt_softplus")
ACTIVATIONS = ("relu", "gelu", "silu", "swiglu", "identity", "geglu", "geglu_tanh", "relu2", "swiglu_oai")
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "swiglu_oai")   # the first projection gives [gate | up]
LIMITED_ACTIVATIONS = ("swiglu", "swiglu_oai")                         # those activation_limit applies to
GROUP_SCORES = ("top2_sum", "max")
AUX_LOSSES = ("gshard", "switch", "none", "seq", "load_importance")
AUX_LOSS_SCOPES = ("local", "global")
CAPACITY_FORMULAS = ("ceil", "tutel")
GATE_NOISE_KINDS = ("choice", "tutel")
GATE_NORMALIZATIONS = ("before_drop", "after_drop", "none")
A2A_KINDS = ("flat", "2dh", "auto")
RECOMPUTE_MODES = ("none", "experts")
AUTO = ("auto", "auto_once")


def gate_normalization(value: Any, top_k: Any) -> Any:
    """normalize_gate as a MoEConfig holds it (see MoEConfig): booleans become the string they mean at top_k."""
    if isinstance(value, bool):
        return "before_drop" if value and isinstance(top_k, int) and top_k > 1 else "none"
    return value


@dataclass
class MoEConfig:
    """Configuration of one MoE layer.

    model_dim: D, the width of the tokens the layer takes and returns.
    hidden_size: H, each expert's hidden width (a gated activation's first projection has 2H columns).
    num_experts: E, the number of experts (routed; a shared expert is not counted).
    top_k: K, how many experts each token goes to: its top_k best by router score (1 to num_experts).
    eval_capacity_factor: used instead of capacity_factor in eval mode (None: the same).
    min_capacity: the lower bound of a fixed capacity.
    gate_noise: std of Gaussian noise added to the logits to choose experts (training only); see gate_noise_kind.
    gate_noise_kind: "choice": the noise only chooses experts (gates from the clean scores); "tutel": noise of std
      gate_noise / num_experts is added to the logits before the softmax, and gates, choices and the balance
      loss all see the noisy scores (Tutel).
    fp32_router: compute the router in at least fp32 (rounded logits would flip routes).
    batch_prioritized_routing: tokens with the highest router score claim slots first (else token order).
    aux_loss_coef: the weight of the balance loss (see aux_loss) in layer.aux_loss.
    z_loss_coef: the weight of the router z-loss (the mean squared logsumexp of the logits) in layer.aux_loss.
    bias: the experts' Linears have biases.
    node_size: processes per node for a2a "2dh" (None: LOCAL_WORLD_SIZE).
    shared_gate: the shared expert's output is multiplied per token by sigmoid(x . w) (Qwen2-MoE).
    clamp_shared: False keeps the shared expert unclamped when activation_limit is set (HY-V4).
    router_norm_eps: the epsilon of router_norm's RMS normalization.
    capacity_factor > 0: fixed capacity per expert, max(ceil(top_k * cf * T / E), min_capacity); with
      capacity_formula "tutel" max(top_k * int(cf * ceil(T / E)), min_capacity) rounded up to a multiple of
      capacity_alignment (Tutel's).
    capacity_factor == 0: dropless, capacity = the largest real load.
    capacity_factor < 0: adaptive, the largest real load capped at |cf| times the fixed capacity.
    normalize_gate: "before_drop", "after_drop" or "none". True is "before_drop" for top_k > 1 and "none"
      for top-1 (a lone gate keeps its probability, as in Switch, GShard and DeepSpeed); False is "none".
      The strings apply at every top_k: a normalized top-1 gate is 1 (as in HF Mixtral with one expert).
    ep_size: processes the experts are spread over (1: every process holds all experts).
    parallel: 0 = experts gathered (data parallel), 1 = expert parallel, r > 1 = each expert sliced
      over r processes (needs ep_size > num_experts); "auto" picks r per step's load, re-tuned as the load
      drifts (parallel/tuner.py); "auto_once" times the candidates once at the start and keeps the fastest.
    overlap_degree: the exchange is cut into this many chunks so one chunk's all-to-all overlaps
      another's expert compute; "auto" / "auto_once" as for parallel.
    a2a: "flat" or "2dh" (exchange inside a node, then across nodes; node_size from the config or
      LOCAL_WORLD_SIZE); "auto" lets the tuner pick one (with parallel / overlap_degree "auto" or
      "auto_once"; alone it means "auto").
    aux_loss: "gshard" counts first choices, "switch" all top-k choices, "seq" is DeepSeek-V3's
      sequence-wise loss (switch per sequence of an input [..., S, D], averaged over sequences);
      "load_importance" is Tutel's (Shazeer et al.'s importance and load losses, averaged; needs gate_noise > 0
      with gate_noise_kind "tutel").
    aux_loss_scope: "local" counts the balance loss's expert frequencies over this process's tokens; "global"
      over every process's (gshard, switch, seq; all-reduced in training, no gradient through the counts), so that
      under data parallelism with gradients averaged over processes the router's gradient from the balance loss
      equals one process's on all processes' tokens together (router.global_balance_loss).
    expert_bias_update_rate > 0: auxiliary-loss-free balancing (DeepSeek-V3). A per-expert bias
      (router.expert_bias_E) is added to the scores to choose experts, never to the gates;
      moe_plugin.update_expert_bias(model) moves it by rate * sign(mean load - load) once per step.
    num_groups: the experts form this many groups of consecutive experts (1: no groups; DeepSeek-V3's n_group).
    topk_groups: a token chooses its experts only inside its topk_groups best groups (scored by group_score).
    route_scale: multiplies the final gates (after normalization and dropping).
    shared_hidden_size > 0: a shared expert FFN of that width applied to every token and added to the
      output; shared_gate multiplies it per token by sigmoid(x . w).
    activation: relu, gelu (exact), silu, identity, relu2 (relu(h)^2) act on the hidden layer; the gated ones
      split the first projection's 2H columns into [gate | up]: swiglu silu(gate) * up, geglu gelu(gate) * up
      (exact erf GELU), geglu_tanh (tanh-approximate GELU), swiglu_oai (gpt-oss)
      (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=L).
    activation_limit: L. With swiglu: gate clamped to at most L, up to [-L, L] (GLM-5-Next, DeepSeek-V4,
      HY-V4); required by swiglu_oai. clamp_shared=False keeps the shared expert unclamped (HY-V4).
    activation_alpha: swiglu_oai's alpha (gpt-oss: 1.702); only with swiglu_oai, which requires it.
    router: softmax, sigmoid, cosine, or sqrt_softplus (DeepSeek-V4: sqrt(softplus(logits)), used like sigmoid).
    router_bias: the router's logits add a learned per-expert bias, router.bias_E (gpt-oss).
    gate_on_input: the gate multiplies the chosen expert's input, not its output (Llama 4 at top-1; Tutel's
      is_postscore=False at any top_k: each choice's expert gets x times its own gate).
    capacity_formula: "ceil" or "tutel": how capacity_factor gives the fixed capacity (see capacity_factor).
    capacity_alignment: with capacity_formula "tutel", the fixed capacity is rounded up to a multiple of it.
    router_proj_dim > 0: the cosine router projects its input to this width first (a Linear with bias,
      router.projector) and router.weight_ED is [E, router_proj_dim] (Tutel's cosine_top gate); router cosine only.
    group_score: how a group of experts is scored for topk_groups: "top2_sum" (DeepSeek-V3: the sum of its two
      best scores) or "max" (DeepSeek-V2 group_limited_greedy: its best score); "max" needs topk_groups <
      num_groups.
    router_norm: the router's input is RMS-normalized (no weight, eps router_norm_eps), times a learned
      per-channel router.input_scale_D, times model_dim ** -0.5 (Gemma 4's router).
    expert_gate_scale: each chosen gate (after normalization) is multiplied by a learned per-expert
      router.gate_scale_E (Gemma 4's per_expert_scale).
    redundant_experts: R, up to R extra copies of the hottest experts on the least-loaded ranks of the
      expert-parallel group, re-planned every forward from its gathered counts (parallel/replicas.py); a replicated
      expert's rows are split between its copies so that the ranks even out. Copies are not parameters: the owner's
      weights travel to them each forward and their gradients come back into the owner's. 0: none. At ep_size 1 it
      does nothing (every process holds every expert: nothing to balance; so a config rebuilt at ep_size 1, as
      checkpoint tools and plans do, keeps working). At ep_size > 1 it needs whole experts per rank (num_experts >=
      ep_size) and parallel not 0 (a tuner's r = 0 copies nothing). "auto": the tuner (parallel/tuner.py) chooses R
      per load, timing 0, the cost model's count (copies whose weight traffic costs less than the busiest rank's
      compute they save) and the count that levels the ranks (only 0 on a flat load); under "auto_once" each
      forward makes the cost model's count. Where copies cannot work (sliced experts, parallel 0, expert modules)
      "auto" makes none.
    recompute: what the expert FFN keeps for backward. "none": the first projection's output (the [rows, 2H]
      pre-activation of a gated activation; the activation itself is recomputed from it). "experts": only the
      layer's input and the routing; backward gathers the rows and runs the first projection again (one more
      grouped GEMM). With expert parallelism the experts keep the rows they received ([rows, D]) instead.
    """

    model_dim: int
    hidden_size: int
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.0
    eval_capacity_factor: Optional[float] = None
    min_capacity: int = 4
    router: str = "softmax"
    gate_noise: float = 0.0
    fp32_router: bool = True
    normalize_gate: Union[bool, str] = True
    batch_prioritized_routing: bool = False
    aux_loss: str = "gshard"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    activation: str = "relu"
    bias: bool = True
    ep_size: int = 1
    parallel: Union[int, str] = 1
    overlap_degree: Union[int, str] = 1
    a2a: str = "flat"
    node_size: Optional[int] = None
    expert_bias_update_rate: float = 0.0
    num_groups: int = 1
    topk_groups: int = 1
    route_scale: float = 1.0
    shared_hidden_size: int = 0
    shared_gate: bool = False
    activation_limit: Optional[float] = None
    activation_alpha: Optional[float] = None
    clamp_shared: bool = True
    router_bias: bool = False
    gate_on_input: bool = False
    group_score: str = "top2_sum"
    router_norm: bool = False
    router_norm_eps: float = 1e-6
    expert_gate_scale: bool = False
    recompute: str = "none"
    capacity_formula: str = "ceil"
    capacity_alignment: int = 1
    gate_noise_kind: str = "choice"
    router_proj_dim: int = 0
    aux_loss_scope: str = "local"
    redundant_experts: Union[int, str] = 0

    def __new__(cls, *args, **kwargs):
        _reject_unknown_keys(kwargs)
        return super().__new__(cls)

    def __post_init__(self):
        for name in ("model_dim", "hidden_size", "num_experts"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("min_capacity", self.min_capacity, minimum=0)
        _check_int("top_k", self.top_k, minimum=1)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} is invalid: must be between 1 and "
                f"num_experts={self.num_experts}")
        self.capacity_factor = _check_float("capacity_factor", self.capacity_factor)
        if self.eval_capacity_factor is not None:
            self.eval_capacity_factor = _check_float("eval_capacity_factor", self.eval_capacity_factor)
        self.gate_noise = _check_float("gate_noise", self.gate_noise, minimum=0.0)
        self.aux_loss_coef = _check_float("aux_loss_coef", self.aux_loss_coef, minimum=0.0)
        self.z_loss_coef = _check_float("z_loss_coef", self.z_loss_coef, minimum=0.0)
        for name in ("fp32_router", "batch_prioritized_routing", "bias"):
            _check_bool(name, getattr(self, name))
        self.normalize_gate = gate_normalization(self.normalize_gate, self.top_k)
        _check_choice("normalize_gate", self.normalize_gate, GATE_NORMALIZATIONS)
        _check_choice("router", self.router, ROUTERS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("aux_loss", self.aux_loss, AUX_LOSSES)
        _check_choice("aux_loss_scope", self.aux_loss_scope, AUX_LOSS_SCOPES)
        if self.aux_loss_scope == "global" and self.aux_loss == "load_importance":
            raise ValueError("MoEConfig.aux_loss_scope='global' is invalid with aux_loss='load_importance': global "
                             "counts apply to the gshard, switch and seq losses; use aux_loss_scope='local'")
        _check_int("ep_size", self.ep_size, minimum=1)
        _check_int_or_auto("parallel", self.parallel, minimum=0)
        _check_int_or_auto("overlap_degree", self.overlap_degree, minimum=1)
        _check_choice("a2a", self.a2a, A2A_KINDS)
        modes = {name: getattr(self, name) for name in ("parallel", "overlap_degree") if getattr(self, name) in AUTO}
        if len(set(modes.values())) > 1:
            raise ValueError(f"MoEConfig.parallel={self.parallel!r} and overlap_degree={self.overlap_degree!r} mix "
                             f"the tuners: use \"auto\" for both (per-load, re-tuned) or \"auto_once\" for both")
        if self.node_size is not None:
            _check_int("node_size", self.node_size, minimum=1)
        self._check_routing_extras()
        self._check_expert_features()
        self._check_replicas()

    def _check_replicas(self):
        if self.redundant_experts == "auto":
            return
        if isinstance(self.redundant_experts, bool) or not isinstance(self.redundant_experts, int) \
                or self.redundant_experts < 0:
            raise ValueError(f"MoEConfig.redundant_experts={self.redundant_experts!r} is invalid: must be an integer "
                             f">= 0 or \"auto\"")
        if self.redundant_experts == 0:
            return
        why = None
        if self.ep_size == 1:       # nothing to balance: no copy (see the docstring)
            return
        if self.num_experts < self.ep_size:
            why = (f"with num_experts={self.num_experts} < ep_size={self.ep_size} each expert is sliced over ranks; "
                   f"copies need whole experts per rank (num_experts >= ep_size)")
        elif self.parallel == 0:
            why = ("with parallel=0 every rank gathers every expert: there is nothing to replicate; use parallel=1 or "
                   "\"auto\"")
        if why:
            raise ValueError(f"MoEConfig.redundant_experts={self.redundant_experts} is invalid: {why}")

    def _check_routing_extras(self):
        self.expert_bias_update_rate = _check_float("expert_bias_update_rate", self.expert_bias_update_rate,
                                                    minimum=0.0)
        _check_int("num_groups", self.num_groups, minimum=1)
        _check_int("topk_groups", self.topk_groups, minimum=1)
        if self.num_experts % self.num_groups:
            raise ValueError(f"MoEConfig.num_groups={self.num_groups} is invalid: must divide "
                             f"num_experts={self.num_experts}")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"MoEConfig.topk_groups={self.topk_groups} is invalid: must be between 1 and "
                             f"num_groups={self.num_groups}")
        reachable = self.topk_groups * (self.num_experts // self.num_groups)
        if self.top_k > reachable:
            raise ValueError(f"MoEConfig.top_k={self.top_k} is invalid: must be at most topk_groups * "
                             f"num_experts / num_groups = {reachable} (the experts in the chosen groups)")
        if isinstance(self.route_scale, bool) or not isinstance(self.route_scale, (int, float)) \
                or not math.isfinite(self.route_scale) or self.route_scale <= 0:
            raise ValueError(f"MoEConfig.route_scale={self.route_scale!r} is invalid: must be a finite number > 0")
        self.route_scale = float(self.route_scale)
        _check_int("shared_hidden_size", self.shared_hidden_size, minimum=0)
        _check_bool("shared_gate", self.shared_gate)
        if self.shared_gate and self.shared_hidden_size == 0:
            raise ValueError("MoEConfig.shared_gate=True is invalid with shared_hidden_size=0: the gate "
                             "multiplies the shared expert; set shared_hidden_size > 0 or shared_gate=False")

    def _check_expert_features(self):
        for name in ("activation_limit", "activation_alpha"):
            value = getattr(self, name)
            if value is not None:
                value = _check_float(name, value)
                if value <= 0:
                    raise ValueError(f"MoEConfig.{name}={value!r} is invalid: must be a finite number > 0 or None")
                setattr(self, name, value)
        if self.activation_limit is not None and self.activation not in LIMITED_ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation_limit={self.activation_limit!r} is invalid with "
                             f"activation={self.activation!r}: the limit clamps only "
                             f"{' and '.join(LIMITED_ACTIVATIONS)}")
        if self.activation == "swiglu_oai" and (self.activation_limit is None or self.activation_alpha is None):
            raise ValueError(f"MoEConfig.activation='swiglu_oai' needs activation_limit and activation_alpha "
                             f"(gpt-oss: 7.0 and 1.702); got activation_limit={self.activation_limit!r}, "
                             f"activation_alpha={self.activation_alpha!r}")
        if self.activation_alpha is not None and self.activation != "swiglu_oai":
            raise ValueError(f"MoEConfig.activation_alpha={self.activation_alpha!r} is invalid with "
                             f"activation={self.activation!r}: alpha belongs to activation='swiglu_oai' only")
        for name in ("clamp_shared", "router_bias", "gate_on_input"):
            _check_bool(name, getattr(self, name))
        if not self.clamp_shared and self.activation_limit is None:
            raise ValueError("MoEConfig.clamp_shared=False is invalid with activation_limit=None: it exempts the "
                             "shared expert from the limit; set activation_limit or clamp_shared=True")
        if self.router_bias and self.router == "cosine":
            raise ValueError("MoEConfig.router_bias=True is invalid with router='cosine' (its logits are bounded "
                             "cosine similarities); use router_bias=False or another router")
        self._check_tutel_options()
        _check_choice("group_score", self.group_score, GROUP_SCORES)
        _check_choice("recompute", self.recompute, RECOMPUTE_MODES)
        for name in ("router_norm", "expert_gate_scale"):
            _check_bool(name, getattr(self, name))
        self.router_norm_eps = _check_float("router_norm_eps", self.router_norm_eps)
        if self.router_norm_eps <= 0:
            raise ValueError(f"MoEConfig.router_norm_eps={self.router_norm_eps!r} is invalid: must be a finite "
                             f"number > 0")
        if self.router_norm and self.router == "cosine":
            raise ValueError("MoEConfig.router_norm=True is invalid with router='cosine' (which normalizes its input "
                             "itself); use router_norm=False or another router")
        if self.group_score != "top2_sum" and self.topk_groups >= self.num_groups:
            raise ValueError(f"MoEConfig.group_score={self.group_score!r} is invalid with num_groups="
                             f"{self.num_groups}, topk_groups={self.topk_groups}: groups are scored only when "
                             f"topk_groups < num_groups")

    def _check_tutel_options(self):
        _check_choice("capacity_formula", self.capacity_formula, CAPACITY_FORMULAS)
        _check_int("capacity_alignment", self.capacity_alignment, minimum=1)
        _check_choice("gate_noise_kind", self.gate_noise_kind, GATE_NOISE_KINDS)
        _check_int("router_proj_dim", self.router_proj_dim, minimum=0)
        if self.router_proj_dim and self.router != "cosine":
            raise ValueError(f"MoEConfig.router_proj_dim={self.router_proj_dim} is invalid with router="
                             f"{self.router!r}: the projection belongs to router='cosine'")
        if self.aux_loss == "load_importance" and (self.gate_noise <= 0 or self.gate_noise_kind != "tutel"):
            raise ValueError(f"MoEConfig.aux_loss='load_importance' needs gate_noise > 0 with gate_noise_kind="
                             f"'tutel' (its load term divides by the noise); got gate_noise={self.gate_noise}, "
                             f"gate_noise_kind={self.gate_noise_kind!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "MoEConfig":
        if not isinstance(values, Mapping):
            raise TypeError(f"MoEConfig.from_dict expects a mapping, got {type(values).__name__}")
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, path: str, section: Optional[str] = None) -> "MoEConfig":
        """Read a YAML file (optionally one top-level section of it) with OmegaConf."""
        try:
            from omegaconf import OmegaConf
        except ImportError as error:
            raise ImportError("MoEConfig.from_yaml needs omegaconf: pip install omegaconf") from error
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        if section is not None:
            if section not in values:
                raise ValueError(f"{path} has no section {section!r}; it has {sorted(values)}")
            values = values[section]
        return cls.from_dict(values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "MoEConfig":
        _reject_unknown_keys(changes)
        return dataclasses.replace(self, **changes)


def field_names() -> list:
    return [f.name for f in dataclasses.fields(MoEConfig)]


def _reject_unknown_keys(values: Mapping[str, Any]) -> None:
    known = field_names()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"MoEConfig has no field {key!r}{hint}; known fields: {', '.join(known)}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"MoEConfig.{name}={value!r} is invalid: must be an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"MoEConfig.{name}={value!r} is invalid: must be an integer >= {minimum}")


def _check_int_or_auto(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, str) and value in AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"MoEConfig.{name}={value!r} is invalid: must be \"auto\", \"auto_once\" or an integer "
                         f">= {minimum}")


def _check_float(name: str, value: Any, minimum: Optional[float] = None) -> float:
    allowed = "a finite number" + ("" if minimum is None else f" >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"MoEConfig.{name}={value!r} is invalid: must be {allowed}")
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        raise ValueError(f"MoEConfig.{name}={value!r} is invalid: must be {allowed}")
    return float(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"MoEConfig.{name}={value!r} is invalid: must be true or false")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if not isinstance(value, str) or value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"MoEConfig.{name}={value!r} is invalid: must be one of {shown}")
