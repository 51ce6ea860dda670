"""Stacked expert FFN weights and their compute on the routed rows only.

Shape legend: moe_plugin/__init__.py (here R routed rows grouped by expert, D model dim, H expert hidden dim, E experts,
Q LoRA rank, I and O a GEMM's in and out width). With a gated activation (swiglu, geglu, ...) the first
projection gives F = 2H columns: [gate | up]; w1_EDH and b1_EH (the state dict's names) hold F columns.
"""
from __future__ import annotations

import math
from typing import Any, List, Mapping, NamedTuple, Optional

import torch
from torch import nn

from . import ops
from .ops import fused_gemms
from .activations import activate, activation_backward, activation_backward_, first_width, kept, of_config  # noqa: F401
from .activations import forward as activation_forward
from .config import ACTIVATIONS as ACTIVATION_NAMES
from .config import MoEConfig

# name -> function of the pre-activation, for the activations without parameters (hosts match modules by it)
ACTIVATIONS = {name: (lambda pre, name=name: activation_forward(pre, name))
               for name in ACTIVATION_NAMES if name != "swiglu_oai"}


class _Cast(torch.autograd.Function):
    """w.to(dtype) whose output and gradient (back in w's dtype) come from ops.new_empty: under autocast
    the expert weights are cast every step, and on CPU fresh memory for them costs more than the copy."""

    @staticmethod
    def forward(ctx, w, dtype):
        ctx.dtype = w.dtype
        return ops.new_empty(w, *w.shape, dtype=dtype).copy_(w)

    @staticmethod
    def backward(ctx, grad):
        return ops.new_empty(grad, *grad.shape, dtype=ctx.dtype).copy_(grad), None


class ExpertWeights(NamedTuple):
    """The stacked weights the expert GEMMs run with (a rank's own, cast, or gathered over ranks): the first four
    fields are the experts' parameters, whose names (WEIGHT_NAMES) are those of every state dict."""
    w1_EDH: torch.Tensor
    b1_EH: Optional[torch.Tensor]
    w2_EHD: torch.Tensor
    b2_ED: Optional[torch.Tensor]
    activation: Any = None          # activations.Activation
    lora: tuple = (None, None, None, None)     # lora_factors()
    recompute: bool = False         # MoEConfig.recompute == "experts": backward runs the first projection again

    @property
    def has_lora(self) -> bool:
        """Whether any projection has a LoRA factor (the one-node paths take none)."""
        return self.lora is not NO_LORA and any(f is not None for f in self.lora)


WEIGHT_NAMES = ExpertWeights._fields[:4]     # ("w1_EDH", "b1_EH", "w2_EHD", "b2_ED")
BIAS_NAMES = WEIGHT_NAMES[1::2]              # ("b1_EH", "b2_ED")


RECORD = "moe_plugin_experts"    # an MoELayer's entry in a state dict's metadata: expert_record of what it holds


def expert_record(layout) -> dict:
    """Which experts a rank's expert stacks hold: global experts [lo, hi) (their hidden slice `slice` of `slices`)
    of num_experts, and the layout that wrote them."""
    first = layout.first_expert
    return {"num_experts": layout.num_experts, "ep_size": layout.ep_size, "ep_rank": layout.ep_rank,
            "experts": [first, first + layout.local_experts], "slices": layout.slices, "slice": layout.slice_index}


def short_name(name: str) -> str:
    """"w1" for "w1_EDH": the key of one expert's tensors (Experts.full_expert, take_slice)."""
    return name.split("_")[0]


def cast_weights(experts, dtype: torch.dtype) -> ExpertWeights:
    """The experts' weights (and LoRA factors) in dtype, differentiably (gradients return in the parameters' dtype)."""
    lora = lora_factors(experts)
    weights = [getattr(experts, name) for name in WEIGHT_NAMES]
    recompute = experts.recompute
    if weights[0].dtype == dtype and (lora is NO_LORA or all(f is None or f.dtype == dtype for f in lora)):
        return ExpertWeights(*weights, experts.activation, lora, recompute)
    weights = [None if w is None else _Cast.apply(w, dtype) for w in weights]
    lora = tuple(None if f is None else f if f.dtype == dtype else _Cast.apply(f, dtype) for f in lora)
    return ExpertWeights(*weights, experts.activation, lora, recompute)


def weight_grad(a_RI: torch.Tensor, grad_RO: torch.Tensor, offs_E: torch.Tensor, w_EIO: torch.Tensor,
                grouped_mm=ops.grouped_mm) -> torch.Tensor:
    """The [E, I, O] gradient of w_EIO (rows a_RI in, grads grad_RO out), laid out in memory as w_EIO is: a
    transposed view of a host's [E, O, I] weights (Hugging Face's experts) gets it without a layout copy.
    grouped_mm: the grouped GEMM to run (ops.grouped_mm's weight-gradient form; one_process/node_cpu.py passes the native one)."""
    if w_EIO.stride(1) == 1 and w_EIO.stride(2) != 1:
        return grouped_mm(grad_RO.t(), a_RI, offs_E).transpose(1, 2)
    return grouped_mm(a_RI.t(), grad_RO, offs_E)


NO_LORA = (None, None, None, None)


class Needs(NamedTuple):
    """Which gradients a backward pass is asked for (from ctx.needs_input_grad): nothing else is computed."""
    x: bool = True
    w1: bool = True
    b1: bool = True
    w2: bool = True
    b2: bool = True
    up_a: bool = True
    up_b: bool = True
    down_a: bool = True
    down_b: bool = True

    @classmethod
    def of(cls, flags, x: int, weights: int) -> "Needs":
        """From ctx.needs_input_grad: x's index and the index of w1 (then b1, w2, b2 and the four LoRA factors;
        factors not passed count as not needed)."""
        flags = tuple(flags) + (False,) * (weights + 8 - len(flags))
        return cls(flags[x], *flags[weights:weights + 8])

    @property
    def below_activation(self) -> bool:
        """Any gradient that needs the pre-activation's (x, the first projection, its adapter)."""
        return self.x or self.w1 or self.b1 or self.up_a or self.up_b


def lora_factors(experts) -> tuple:
    """(up_a_EDQ, up_b_EQH, down_a_EHQ, down_b_EQD): the experts' LoRA factors (lora.py), each B already times
    its scale; None for a projection without an adapter (or with its adapter merged)."""
    if isinstance(experts, nn.Module):
        # PEFT's factors are a plain attribute, add_lora's adapter a submodule: looked up where each lives (a getattr
        # that misses costs nn.Module an exception, every forward)
        lora = experts.__dict__.get("lora")
        if lora is None:
            lora = experts._modules.get("lora")
    else:       # weights gathered or cast already (ExpertWeights: expert parallelism), or any holder of them
        lora = getattr(experts, "lora", None)
    if lora is None:
        return NO_LORA
    return lora if isinstance(lora, tuple) else lora.factors()


def mlp_forward(x_RD, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED, lora=NO_LORA, up=None):
    """(y_RD, saved_RH, xa_RQ, ha_RQ) of y = act(x W1 + b1 + (x A1) B1) W2 + b2 + (act A2) B2 on grouped rows: the
    low-rank terms on the routed rows (W + A B is never formed); xa_RQ and ha_RQ (None without adapters) are
    what their backward needs besides saved_RH. up: (act_RH, saved_RH) of the first projection computed already
    (a fused kernel, ops/fused_gemms.py; no adapter on it), x_RD then unused."""
    up_a, up_b, down_a, down_b = lora
    xa_RQ = ha_RQ = None
    if up is not None:
        act_RH, saved_RH = up
    else:
        pre_RH, xa_RQ = up_projection(x_RD, offs_E, w1_EDH, b1_EH, up_a, up_b)
        act_RH, saved_RH = activate(pre_RH, activation)
        del pre_RH
    y_RD = ops.grouped_mm(act_RH, w2_EHD, offs_E, b2_ED)
    if down_a is not None:
        ha_RQ = ops.grouped_mm(act_RH, down_a, offs_E)
        add_low_rank(y_RD, ha_RQ, down_b, offs_E)
    return y_RD, saved_RH, xa_RQ, ha_RQ


def up_projection(x_RD, offs_E, w1_EDH, b1_EH, up_a=None, up_b=None):
    """(pre_RH, xa_RQ): x W1 + b1 + (x A1) B1 on grouped rows; xa_RQ None without an up adapter."""
    pre_RH = ops.grouped_mm(x_RD, w1_EDH, offs_E, b1_EH)
    xa_RQ = None
    if up_a is not None:
        xa_RQ = ops.grouped_mm(x_RD, up_a, offs_E)
        add_low_rank(pre_RH, xa_RQ, up_b, offs_E)
    return pre_RH, xa_RQ


def recomputed_up(x_RD, offs_E, activation, w1_EDH, b1_EH, up_a=None, up_b=None):
    """(saved_RH, xa_RQ): what mlp_forward keeps of the first projection, computed again (recompute "experts")."""
    pre_RH, xa_RQ = up_projection(x_RD, offs_E, w1_EDH, b1_EH, up_a, up_b)
    return kept(pre_RH, activation), xa_RQ


LOW_RANK_CHUNK_BYTES = 8 << 20


def add_low_rank(out_RO: torch.Tensor, a_RQ: torch.Tensor, b_EQO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """out_RO += a_RQ b_EQO[e] on each expert's rows, in place, the product made in blocks of rows of at most
    LOW_RANK_CHUNK_BYTES (a multiple of 16 rows: aligned starts for CUDA's grouped GEMM): no second [R, O] buffer
    beside out_RO at the layer's memory peak."""
    R = out_RO.shape[0]
    rows = max(16, LOW_RANK_CHUNK_BYTES // max(1, out_RO.shape[1] * out_RO.element_size()) // 16 * 16)
    if R <= rows:
        return out_RO.add_(ops.grouped_mm(a_RQ, b_EQO, offs_E))
    for start in range(0, R, rows):
        end = min(start + rows, R)    # the block's own offsets: rows of other experts' blocks fall outside [0, end)
        out_RO[start:end].add_(ops.grouped_mm(a_RQ[start:end], b_EQO, (offs_E - start).clamp_(0, end - start)))
    return out_RO


BACKWARD_GRADS = Needs._fields + ("gate",)


def mlp_backward(grad_y_RD, saved_RH, offs_E, activation, w1_EDH, w2_EHD, bias1, bias2, routed_inputs,
                 needs: Needs, lora=NO_LORA, xa_RQ=None, ha_RQ=None, gate_R1=None, b2_ED=None):
    """(grad_x_RD, grad_w1, grad_b1, grad_w2, grad_b2, grad_up_a, grad_up_b, grad_down_a, grad_down_b, grad_gate_R)
    of mlp_forward (BACKWARD_GRADS), None for each gradient needs does not ask for (its GEMMs are not run).
    routed_inputs() gives x_RD; it is called once the activations are freed, so a caller may gather the rows again
    only then. A fused_gemms.RoutedRows there lets the first weight gradient read the rows from x by index instead.

    With gate_R1 ([R, 1], the gate each row's output is scaled by; b2_ED the second bias, if any): grad_y_RD is the
    rows' gradient before the gate scales it (scaled here, in place, unless w2's gradient is its only reader: then
    SwiGLU's kernel scales the activations it writes instead), and grad_gate_R [R] is <grad_y_RD[r], expert
    output r> = <grad_y_RD[r] W2^T (+ its LoRA term), act[r]> + <grad_y_RD[r], b2>: the down projection's own dgrad
    and the activations give it, so no caller need keep the expert outputs."""
    up_a, up_b, down_a, down_b = lora
    grads = dict.fromkeys(BACKWARD_GRADS)
    below = needs.below_activation
    gated = gate_R1 is not None
    act_RH = grad_pre_RH = grad_ha_RQ = None
    if down_a is not None and (below or needs.down_a or gated):
        grad_ha_RQ = ops.grouped_mm(grad_y_RD, down_b.transpose(1, 2), offs_E)
    if below or gated:
        # the dgrad GEMM with the activation's backward in its epilogue, where that kernel runs and measured faster
        one_pass = fused_gemms.dgrad_activation(grad_y_RD, offs_E, w2_EHD, saved_RH, activation, gate_R1) \
            if gated and below and grad_ha_RQ is None else None
        grad_act_RH = None
        act_scaled = False    # act_RH times the gate: w2's gradient from the unscaled grad_y_RD (no pass scaling it)
        if one_pass is None:
            grad_act_RH = ops.grouped_mm(grad_y_RD, w2_EHD.transpose(1, 2), offs_E)
            if grad_ha_RQ is not None:
                add_low_rank(grad_act_RH, grad_ha_RQ, down_a.transpose(1, 2), offs_E)
            if gated and below:     # only w2's gradient reads grad_y_RD scaled, unless b2 or a down adapter does
                act_scaled = not bias2 and grad_ha_RQ is None
                one_pass = fused_gemms.activation_backward_scaled(saved_RH, grad_act_RH, activation, gate_R1,
                                                                  act_scaled)
                act_scaled = act_scaled and one_pass is not None
        if one_pass is not None:    # the gate scale and the gate gradient's row sums inside the activation's backward
            act_RH, grad_pre_RH, grads["gate"] = one_pass
        elif below:   # relu and identity write grad_pre_RH into grad_act_RH (the dot below is the same: 0 where act
            # is); SwiGLU writes it over the dead saved_RH where it can, act_RH over grad_act_RH unless the dot reads it
            act_RH, grad_pre_RH = activation_backward_(saved_RH, grad_act_RH, activation, keep_grad_act=gated)
        else:
            act_RH = activate(saved_RH, activation)[0]
        if gated:
            if one_pass is None:
                grads["gate"] = ops.row_dot(grad_act_RH, act_RH)
            y_scaled = act_scaled     # grad_y_RD needs no scale pass: act_RH carries the gate, or a kernel scaled it
            if b2_ED is not None:     # the second bias's share, and grad_y_RD's gate scale in the same pass
                y_scaled = fused_gemms.bias_dot_and_scale(grad_y_RD, b2_ED, offs_E, gate_R1, grads["gate"])
                if not y_scaled:
                    grads["gate"] += ops.grouped_mm(grad_y_RD, b2_ED.unsqueeze(2), offs_E).squeeze(1)
            for unscaled in (None if y_scaled else grad_y_RD, None if one_pass else grad_pre_RH, grad_ha_RQ):
                if unscaled is not None:
                    unscaled.mul_(gate_R1)
        del grad_act_RH
    elif needs.w2 or (needs.down_a and down_a is not None):
        act_RH = activate(saved_RH, activation)[0]
    if needs.w2:
        grads["w2"] = weight_grad(act_RH, grad_y_RD, offs_E, w2_EHD)
    if bias2 and needs.b2:
        grads["b2"] = ops.grouped_sum(grad_y_RD, offs_E)
    if down_a is not None:
        grads["down_b"] = weight_grad(ha_RQ, grad_y_RD, offs_E, down_b) if needs.down_b else None
        grads["down_a"] = weight_grad(act_RH, grad_ha_RQ, offs_E, down_a) if needs.down_a else None
    del act_RH, grad_ha_RQ
    if not below:
        return tuple(grads.values())     # in BACKWARD_GRADS' order (dict.fromkeys above)
    lora_x = needs.up_a and up_a is not None      # the up adapter's gradient needs the gathered rows anyway
    # the first weight gradient (and the bias's) reading x's rows by index, where that kernel runs and measured faster
    read = fused_gemms.weight_grad_gathered(routed_inputs, grad_pre_RH, offs_E, w1_EDH, bias1 and needs.b1) \
        if needs.w1 and not lora_x and isinstance(routed_inputs, fused_gemms.RoutedRows) else None
    if read is not None:
        grads["w1"], grads["b1"] = read
    x_RD = routed_inputs() if (needs.w1 and read is None) or lora_x else None
    if needs.w1 and read is None:
        grads["w1"] = weight_grad(x_RD, grad_pre_RH, offs_E, w1_EDH)
    if bias1 and needs.b1 and read is None:
        grads["b1"] = ops.grouped_sum(grad_pre_RH, offs_E)
    grad_xa_RQ = None
    if up_a is not None:
        grads["up_b"] = weight_grad(xa_RQ, grad_pre_RH, offs_E, up_b) if needs.up_b else None
        if needs.x or needs.up_a:
            grad_xa_RQ = ops.grouped_mm(grad_pre_RH, up_b.transpose(1, 2), offs_E)
        grads["up_a"] = weight_grad(x_RD, grad_xa_RQ, offs_E, up_a) if needs.up_a else None
    del x_RD
    if needs.x:
        grad_x_RD = ops.grouped_mm(grad_pre_RH, w1_EDH.transpose(1, 2), offs_E)
        if grad_xa_RQ is not None:
            grad_x_RD.add_(ops.grouped_mm(grad_xa_RQ, up_a.transpose(1, 2), offs_E))
        grads["x"] = grad_x_RD
    return tuple(grads.values())


class GroupedMLP(torch.autograd.Function):
    """y = act(x W1[e] + b1[e]) W2[e] + b2[e] for each expert's block of rows (ends in offs_E, on the
    device; rows past the last offset give 0), on the grouped GEMM op; with LoRA factors (up_a_EDQ, up_b_EQH,
    down_a_EHQ, down_b_EQD, B times its scale; any pair None) their low-rank terms on the same rows.
    Backward computes only the gradients asked for (frozen weights cost no GEMM)."""

    @staticmethod
    def forward(ctx, x_RD, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED,
                up_a_EDQ=None, up_b_EQH=None, down_a_EHQ=None, down_b_EQD=None, recompute=False):
        x_RD = x_RD.contiguous()
        lora = (up_a_EDQ, up_b_EQH, down_a_EHQ, down_b_EQD)
        y_RD, saved_RH, xa_RQ, ha_RQ = mlp_forward(x_RD, offs_E, activation, w1_EDH, b1_EH, w2_EHD, b2_ED, lora)
        if recompute:     # backward runs the first projection again from x_RD, kept anyway
            saved_RH = xa_RQ = None
        ctx.save_for_backward(x_RD, saved_RH, offs_E, w1_EDH, w2_EHD, xa_RQ, ha_RQ, b1_EH if recompute else None,
                              *lora)
        ctx.activation = activation
        ctx.bias1, ctx.bias2 = b1_EH is not None, b2_ED is not None
        return y_RD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_RD):
        x_RD, saved_RH, offs_E, w1_EDH, w2_EHD, xa_RQ, ha_RQ, b1_EH, *lora = ctx.saved_tensors
        if saved_RH is None:
            saved_RH, xa_RQ = recomputed_up(x_RD, offs_E, ctx.activation, w1_EDH, b1_EH, *lora[:2])
        grad_x_RD, *grads, _ = mlp_backward(
            grad_y_RD.contiguous(), saved_RH, offs_E, ctx.activation, w1_EDH, w2_EHD, ctx.bias1, ctx.bias2,
            lambda: x_RD, Needs.of(ctx.needs_input_grad, x=0, weights=3), tuple(lora), xa_RQ, ha_RQ)
        return (grad_x_RD, None, None, *grads, None)


class BaseExperts(nn.Module):
    """The experts contract, met by Experts (stacked weights, the fast path) and ModuleExperts (any module):

    forward(x_RD, rows_per_expert) -> y_RD      the experts on routed rows grouped by expert (rows past the last
                                                block give 0)
    weights(dtype)                              ExpertWeights in dtype (differentiable), or None: no stacked
                                                weights, the dispatchers run forward on the routed rows instead
    stacked                                     whether weights() gives ExpertWeights (the state dict holds
                                                experts.<WEIGHT_NAMES>)
    parallel_degrees(layout), check_degree(layout, r)
                                                the expert-parallel degrees r they allow (any overlap degree)
    local_share(state, prefix, first)           a state dict holding every expert (or whole experts from `first` on)
                                                cut to this rank's share
    parameter_dtype(default)                    the dtype inputs must have outside autocast

    Parameters keep the attributes hosts set on them across to_empty."""

    stacked = False

    def weights(self, dtype: torch.dtype) -> Optional["ExpertWeights"]:
        return None

    def parallel_degrees(self, layout) -> List[int]:
        return layout.degrees()

    def check_degree(self, layout, r: int) -> None:
        layout.check_degree(r)

    def parameter_dtype(self, default: torch.dtype) -> torch.dtype:
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), default)

    def local_share(self, state: Mapping[str, torch.Tensor], prefix: str = "experts.", first: int = 0) -> dict:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        """to_empty (meta -> a device) makes new parameter objects: the attributes hosts set on the old ones
        (DeepSpeed's allreduce and group_name, which mark expert parameters) move to the new ones."""
        tags = {name: dict(vars(param)) for name, param in self.named_parameters() if vars(param)}
        super()._apply(fn, recurse)
        for name, param in self.named_parameters():
            for key, value in tags.get(name, {}).items():
                if not hasattr(param, key):
                    setattr(param, key, value)
        return self


class Experts(BaseExperts):
    """This rank's experts, stacked: w1_EDH [E_local, D, H_local (x2 for gated activations)], w2_EHD [E_local,
    H_local, D]. .activation is an activations.Activation (the name and its limit and alpha).

    Each expert is drawn from its own generator (seeded from the global RNG and the expert's index), so
    the same seed gives the same experts whatever the ep_size; a rank keeps only its share.
    init_std: None draws the weights and biases uniform in +-1/sqrt(fan_in); a float draws the weights
    normal(0, init_std) and zeros the biases (what Hugging Face's _init_weights gives its experts; set by
    swap_moe_blocks).
    """

    init_std: Optional[float] = None
    stacked = True

    def __init__(self, config: MoEConfig, first_expert: int = 0, local_experts: Optional[int] = None,
                 slices: int = 1, slice_index: int = 0):
        super().__init__()
        D, H = config.model_dim, config.hidden_size
        local_experts = config.num_experts if local_experts is None else local_experts
        self.config, self.first_expert = config, first_expert
        self.activation = of_config(config)
        self.slices, self.slice_index = slices, slice_index
        first_out = first_width(config.activation, H) // slices
        self.w1_EDH = nn.Parameter(torch.empty(local_experts, D, first_out))
        self.w2_EHD = nn.Parameter(torch.empty(local_experts, H // slices, D))
        self.b1_EH = nn.Parameter(torch.empty(local_experts, first_out)) if config.bias else None
        self.b2_ED = nn.Parameter(torch.empty(local_experts, D)) if config.bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draws every expert afresh: a base seed from the global CPU RNG, then expert i from its own
        generator. Built on the meta device, it only draws the seed (fill after to_empty)."""
        base_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        if self.w1_EDH.is_meta:
            return
        weights = [self.full_expert(self.config, base_seed + self.first_expert + i, self.init_std)
                   for i in range(self.w1_EDH.shape[0])]
        shards = [self.take_slice(w, self.slices, self.slice_index) for w in weights]
        with torch.no_grad():
            for name in WEIGHT_NAMES:
                param = getattr(self, name)
                if param is not None:
                    param.copy_(torch.stack([w[short_name(name)] for w in shards]))

    @staticmethod
    def full_expert(config: MoEConfig, seed: int, std: Optional[float] = None) -> dict:
        """One whole expert drawn from its seed: uniform in +-1/sqrt(fan_in), or (std given) weights
        normal(0, std) and biases 0."""
        D, H = config.model_dim, config.hidden_size
        first_out = first_width(config.activation, H)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        if std is not None:
            return {"w1": torch.empty(D, first_out).normal_(0.0, std, generator=generator), "b1": torch.zeros(first_out),
                    "w2": torch.empty(H, D).normal_(0.0, std, generator=generator), "b2": torch.zeros(D)}
        return {"w1": _uniform(D, first_out, fan_in=D, generator=generator),
                "b1": _uniform(first_out, fan_in=D, generator=generator),
                "w2": _uniform(H, D, fan_in=H, generator=generator),
                "b2": _uniform(D, fan_in=H, generator=generator)}

    @staticmethod
    def take_slice(expert: dict, slices: int, index: int) -> dict:
        """Hidden slice `index` of `slices` of one expert's tensors (a gated [gate | up] sliced alike)."""
        if slices == 1:
            return expert
        hidden = expert["w2"].shape[0]

        def hidden_cols(t):
            halves = t.chunk(2, dim=-1) if t.shape[-1] == 2 * hidden else (t,)
            return torch.cat([h.chunk(slices, dim=-1)[index] for h in halves], dim=-1)
        shard = {"w1": hidden_cols(expert["w1"]), "w2": expert["w2"].chunk(slices, dim=0)[index]}
        if "b1" in expert:
            shard.update(b1=hidden_cols(expert["b1"]), b2=expert["b2"])
        return shard

    def forward(self, x_RD: torch.Tensor, rows_per_expert) -> torch.Tensor:
        """rows_per_expert: a list of ints or a tensor; x_RD may hold more rows (they give 0)."""
        offs_E = ops.offsets(rows_per_expert, device=x_RD.device)
        return GroupedMLP.apply(x_RD, offs_E, self.activation,
                                self.w1_EDH, self.b1_EH, self.w2_EHD, self.b2_ED, *lora_factors(self), self.recompute)

    weights = cast_weights       # weights(dtype): the contract's, with no call in between

    @property
    def recompute(self) -> bool:
        """MoEConfig.recompute == "experts": backward runs the first projection again."""
        return self.config.recompute == "experts"

    def parameter_dtype(self, default: torch.dtype) -> torch.dtype:
        return self.w1_EDH.dtype

    def local_share(self, state: Mapping[str, torch.Tensor], prefix: str = "experts.", first: int = 0) -> dict:
        """From a state dict holding every expert whole (`<prefix>w1_EDH` [num_experts, ...], ...; a LoRA adapter's
        `<prefix>lora.<factor>` [num_experts, ...] too), or whole experts first, first + 1, ... including this rank's:
        this rank's experts (its hidden slice of them), the rest of the state as given."""
        names = {short_name(name): prefix + name for name in WEIGHT_NAMES if prefix + name in state}
        count = self.w1_EDH.shape[0]
        start = self.first_expert - first       # this rank's first expert in the state's stacks
        shards = [self.take_slice({key: state[name][e] for key, name in names.items()}, self.slices,
                                  self.slice_index) for e in range(start, start + count)]
        share = {**state, **{name: torch.stack([shard[key] for shard in shards]) for key, name in names.items()}}
        adapter = [key for key in state if key.startswith(prefix + "lora.")]
        if adapter and getattr(self, "lora", None) is None:
            raise ValueError(f"the state dict holds a LoRA adapter ({adapter[0]}, ...), but this layer has none: call "
                             f"add_lora on the model (same rank and targets) before loading it")
        share.update({key: state[key][start:start + count] for key in adapter})
        return share


def _uniform(*shape: int, fan_in: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(*shape, device="cpu").uniform_(-bound, bound, generator=generator)
