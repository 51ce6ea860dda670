"""PEFT's LoRA on Hugging Face's experts, read by the "moe_plugin" experts backend (experts_backend.py).

PEFT (>= 0.17) adapts a 3-D expert tensor with `LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])`: its ParamWrapper registers, for the duration of each forward, a parametrization on the
experts' parameter whose value is the merged weight W + s * lhs @ rhs (PEFT 0.21: `_LoraFactorsProxy`, for one
active adapter on an fp32/fp16-or-wider stack of several experts). Reading the parameter would form that merged
weight; the backend reads the stored W and the factors instead (factors() below) and adds the low-rank term on
the routed rows with grouped GEMMs. Any other PEFT state (several adapters, a merged-delta proxy, a
parametrization of some other library) is left as PEFT made it: the backend then reads the parameter as before.

The router: PEFT adapts HF's router weight (`target_modules=["gate"]`, which PEFT turns into
`target_parameters=["mlp.gate.weight"]` for MoE families; or that name directly) with a ParamWrapper of a 2-D weight,
whose merged weight W + s B A is [E, D], the router weight's own size. A swapped block shows the router's weight_ED
under HF's name (HFRouterHandle), and its layer's router computes with W + s B A during the block's forward.

Legend: E experts, D model dim, I input dim, O output dim (of the projection x -> x W), Q LoRA rank.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional, Tuple

import torch
from torch import nn

from moe_plugin.config import GATED_ACTIVATIONS
from moe_plugin.layer import MoELayer

from .families import FAMILIES
from . import family as hf_family

PROXY = "_LoraFactorsProxy"     # peft.tuners.lora.layer's class, matched by name: peft need not be imported here
UPCYCLED = " (upcycled)"         # upcycle.py names its blocks' family "<dense model_type> (upcycled)"
# An upcycled block's HF names: Mixtral's for gated experts (what export_hf writes of an upcycled llama or mistral:
# gate_up_proj [E, 2H, D], down_proj [E, D, H], gate.weight [E, D]); up_proj [E, H, D] for the others (as nemotron_h)
UPCYCLED_NAMES = {True: hf_family.routed_experts(),
                  False: (hf_family.same("router.weight_ED", "gate.weight"),
                          hf_family.transposed("experts.w1_EDH", "experts.up_proj"),
                          hf_family.transposed("experts.w2_EHD", "experts.down_proj"))}


def hf_weight_maps(family: str, gated: bool = True) -> Tuple[hf_family.WeightMap, ...]:
    """The weight maps giving a swapped block's tensors their HF names: the family's; an upcycled block's, those of
    UPCYCLED_NAMES (gated: whether its experts are); none for any other block."""
    if family in FAMILIES:
        return FAMILIES[family].weights
    return UPCYCLED_NAMES[gated] if family.endswith(UPCYCLED) else ()


def factors(experts: nn.Module, name: str, transposed: bool
            ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(W, a, b) for experts' parameter name under PEFT's LoRA, in the layer's orientation: W the stored weight
    ([E, O, I] unless transposed, then [E, I, O]); a [E, I, Q] and b [E, Q, O] (b times PEFT's scale) with
    x (W' + a b) = x W' + (x a) b, W' the weight as [E, I, O]. None when name carries no single LoRA factors proxy."""
    parametrizations = getattr(experts, "parametrizations", None)
    if parametrizations is None or name not in parametrizations:
        return None
    chain = parametrizations[name]
    if len(chain) != 1 or type(chain[0]).__name__ != PROXY:
        return None
    proxy = chain[0]
    lhs, rhs = proxy.lhs, proxy.rhs           # the delta in the stored orientation is lhs @ rhs
    a, b = (lhs, rhs) if transposed else (rhs.transpose(1, 2), lhs.transpose(1, 2))
    return chain.original, a.contiguous(), (b * proxy.scaling).contiguous()


def from_peft(lora_A: torch.Tensor, lora_B: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ParamWrapper weights of one expert projection (lora_A [Q*E, I], lora_B [O, Q*E], whatever the stored
    layout) -> the layer's (a [E, I, Q], b [E, Q, O]), unscaled: x W + s (x a) b is what PEFT computes (the columns
    of O in the stored projection's order)."""
    a = lora_A.reshape(num_experts, -1, lora_A.shape[-1]).transpose(1, 2)
    b = lora_B.reshape(lora_B.shape[0], -1, num_experts).permute(2, 1, 0)
    return a.contiguous(), b.contiguous()


def to_peft(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of from_peft: (lora_A [Q*E, I], lora_B [O, Q*E])."""
    E, I, Q = a.shape
    lora_A = a.transpose(1, 2).reshape(E * Q, I)
    lora_B = b.permute(2, 1, 0).reshape(b.shape[2], Q * E)
    return lora_A.contiguous(), lora_B.contiguous()


class HFExpertsHandle(nn.Module):
    """What PEFT finds at a swapped block's `experts`: the layer's expert weights under HF's parameter names (the
    family's: gate_up_proj or up_proj = w1_EDH [E, D, F], down_proj = w2_EHD [E, H, D]; is_transposed, as HF's
    transposed experts), so that LoraConfig(target_parameters=["mlp.experts.gate_up_proj", ...]) targets them and
    gives its factors HF's shapes (lora_A [Q*E, in], lora_B [out, Q*E]): adapters save and load across swapped and
    unswapped models (B's columns follow HF's order, gpt-oss's interleaved gate and up included).

    It holds no parameter of its own (state dicts, parameters() and casts see the layer's once, in the layer); only
    its own named_parameters(recurse=False), which PEFT reads, lists them. It computes nothing: the block reads
    PEFT's factors around it (peft_adapters_in) and the layer adds the low-rank terms."""

    is_transposed = True

    def __init__(self, experts: nn.Module, family: str):
        super().__init__()
        self.__dict__["_experts"] = experts     # not a submodule: the layer owns it
        self.family = family

    def _maps(self):
        gated = self._experts.config.activation in GATED_ACTIVATIONS
        return {w.layer: w for w in hf_weight_maps(self.family, gated) if len(w.hf) == 1}

    def hf_names(self) -> dict:
        """HF's parameter name -> the layer's, for the expert projections."""
        maps = self._maps()
        return {maps[layer].hf[0].rpartition(".")[2]: layer.partition(".")[2]
                for layer in ("experts.w1_EDH", "experts.w2_EHD") if layer in maps}

    def layer_columns(self, hf_name: str) -> Optional[torch.Tensor]:
        """The order that takes HF's output columns of hf_name to the layer's (None: the same order)."""
        layer = "experts." + self.hf_names()[hf_name]
        width = getattr(self._experts, layer.partition(".")[2]).shape[-1]
        labels = torch.arange(width, dtype=torch.float64).view(1, 1, width)      # layer columns, one input row
        hf = self._maps()[layer].to_hf(labels)[0]
        hf_order = hf.reshape(-1).long()     # HF's column j holds the layer's column hf_order[j]
        if torch.equal(hf_order, torch.arange(width)):
            return None
        return torch.argsort(hf_order)

    def __getattr__(self, name: str):
        if not name.startswith("_") and name in ("gate_up_proj", "up_proj", "down_proj"):
            layer_name = self.hf_names().get(name)
            if layer_name is not None:
                weight = getattr(self._experts, layer_name)
                columns = self.layer_columns(name) if _in_peft_merge() else None
                return weight if columns is None else HFOrderedWeight(weight, columns)
        return super().__getattr__(name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """To PEFT's target matching, HF's names of the layer's weights; to anything else (FSDP2, DeepSpeed, torch
        walking the modules), none: they are the layer's, and sharding them twice would break them."""
        if not _called_from_peft():
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return ((f"{prefix}.{hf}" if prefix else hf, getattr(self._experts, layer))
                for hf, layer in self.hf_names().items())

    def forward(self, *args, **kwargs):
        raise TypeError("HFExpertsHandle computes nothing: the swapped block runs its MoELayer")


class HFRouterHandle(nn.Module):
    """What PEFT finds at a swapped block's HF router name (gate, router): the layer's router.weight_ED [E, D] as
    HF's `weight` ([E, D] too), listed to PEFT's target matching only (as HFExpertsHandle's weights). It computes
    nothing: the block reads PEFT's factors around it (router_delta) and its router adds them to its weight."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.__dict__["_router"] = router     # not a submodule: the layer owns it

    def __getattr__(self, name: str):
        if name == "weight":
            return self._router.weight_ED
        return super().__getattr__(name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        if not _called_from_peft():
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return iter([(f"{prefix}.weight" if prefix else "weight", self._router.weight_ED)])

    def forward(self, *args, **kwargs):
        raise TypeError("HFRouterHandle computes nothing: the swapped block runs its MoELayer")


def router_handle_name(family: str) -> Optional[str]:
    """The block attribute HF keeps its router under ("gate" for HF's gate.weight), when the family's router weight
    is one level down the block; None otherwise (no handle: PEFT then finds no router there)."""
    names = [w.hf[0] for w in hf_weight_maps(family) if w.layer == "router.weight_ED" and len(w.hf) == 1]
    if len(names) != 1:
        return None
    module, _, param = names[0].partition(".")
    return module if param == "weight" else None


def add_router_handle(block: nn.Module, router: nn.Module, family: str) -> None:
    name = router_handle_name(family)
    if name is not None and name not in block._modules and not hasattr(type(block), name):
        setattr(block, name, HFRouterHandle(router))


class HFOrderedWeight:
    """What PEFT's merge and unmerge get for a weight the layer keeps in another column order than HF (gpt-oss's
    gate_up_proj: HF interleaves gate and up, the layer keeps [gate | up]): `.data` reads a copy in HF's order and
    assigning `.data` writes it back in the layer's, so PEFT's `param.data += delta` (and its safe merge's
    `param.data = merged`) folds B's HF-ordered columns into the right columns of the layer's weight."""

    def __init__(self, weight: nn.Parameter, columns: torch.Tensor):
        self._weight = weight
        self._columns = columns.to(weight.device)        # HF's column columns[c] is the layer's column c
        self._hf_order = torch.argsort(self._columns)

    dtype = property(lambda self: self._weight.dtype)
    device = property(lambda self: self._weight.device)
    shape = property(lambda self: self._weight.shape)

    @property
    def data(self) -> torch.Tensor:
        return self._weight.data.index_select(-1, self._hf_order)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._weight.data.copy_(value.index_select(-1, self._columns))


def _in_peft_merge() -> bool:
    """Whether PEFT's merge or unmerge (of a ParamWrapper; directly or through get_delta_weight) asks."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name in ("merge", "unmerge") and frame.f_globals.get("__name__", "").startswith("peft."):
            return True
        frame = frame.f_back
    return False


def _called_from_peft() -> bool:
    """Whether the code asking (past nn.Module's own parameters() / named_parameters()) is PEFT's."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == "torch.nn.modules.module":
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("peft.")


def _in_shape_check_of_backend_experts() -> bool:
    """Whether torch's register_parametrization (unsafe=False) is evaluating a parametrization once to check its
    dtype and shape, on an HF experts module that runs on the "moe_plugin" backend (which never reads it)."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code.co_name == "register_parametrization" and \
                frame.f_globals.get("__name__") == "torch.nn.utils.parametrize":
            config = getattr(frame.f_locals.get("module"), "config", None)
            return getattr(config, "_experts_implementation", None) == "moe_plugin"
        frame = frame.f_back
    return False


def answer_shape_checks_cheaply() -> None:
    """PEFT registers its factors proxy on the experts' parameter in every forward, and torch's registration
    evaluates it once to check its dtype and shape: a merged W + s A B per projection, the size of all the experts'
    weights, formed and dropped. For experts on the "moe_plugin" backend, which read W and the factors, that check
    gets W itself (same dtype and shape, no new memory); every other reader still gets PEFT's merged weight.
    Installed once, when peft is importable."""
    try:
        from peft.tuners.lora import layer
    except ImportError:
        return
    proxy = getattr(layer, PROXY, None)
    if proxy is None or getattr(proxy.forward, "_moe_plugin", False):
        return
    merged = proxy.forward

    def forward(self, W):
        if _in_shape_check_of_backend_experts():
            return W
        return merged(self, W)
    forward._moe_plugin = True
    proxy.forward = forward


def check_target_parameters(model: nn.Module, targets) -> None:
    """ValueError if PEFT's target_parameters name a tensor of a swapped block's MoELayer by the layer's own name
    (moe.experts.w1_EDH, moe.router.weight_ED, ...): PEFT's ParamWrapper cannot wrap the layer's parts (it failed at
    the first forward); the block shows PEFT its experts and router under HF's names instead."""
    targets = list(targets or ())
    if not targets:
        return
    for block_name, block in model.named_modules():
        if not (isinstance(block._modules.get("moe"), MoELayer) and hasattr(block, "family")):   # an HFMoEBlock
            continue
        for name, _ in block.moe.named_parameters():
            key = f"{block_name}.moe.{name}"
            for target in targets:
                if key == target or key.endswith(f".{target}"):
                    raise ValueError(f"moe_plugin: LoraConfig target_parameters {target!r} names the swapped layer's "
                                     f"own tensor {key}, which PEFT cannot adapt; target it by HF's names: "
                                     f"{', '.join(hf_parameter_names(block, block_name))}")


def hf_parameter_names(block: nn.Module, block_name: str) -> list:
    """The names target_parameters can give a swapped block's tensors: HF's (e.g. mlp.experts.gate_up_proj)."""
    prefix = block_name.rpartition(".")[2]
    names = []
    handle = block._modules.get("experts")
    if isinstance(handle, HFExpertsHandle):
        names += [f"{prefix}.experts.{hf}" for hf in handle.hf_names()]
    router = router_handle_name(block.family)
    if router is not None and isinstance(block._modules.get(router), HFRouterHandle):
        names.append(f"{prefix}.{router}.weight")
    return names


def refuse_layer_names_in_target_parameters() -> None:
    """Makes PEFT's get_peft_model (and PeftModel.from_pretrained, load_adapter: every injection of an adapter with
    target_parameters) run check_target_parameters first. Installed once, when peft is importable."""
    try:
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:
        return
    inject = BaseTuner._inject_parameters
    if getattr(inject, "_moe_plugin", False):
        return

    def _inject_parameters(self, peft_config, model, *args, **kwargs):
        check_target_parameters(model, getattr(peft_config, "target_parameters", None))
        return inject(self, peft_config, model, *args, **kwargs)
    _inject_parameters._moe_plugin = True
    BaseTuner._inject_parameters = _inject_parameters


PAIRS = {"gate_up_proj": (0, 1), "up_proj": (0, 1), "down_proj": (2, 3)}   # -> positions in the factors


def peft_adapters(block: nn.Module) -> Optional[tuple]:
    """The factors (up_a_EDQ, up_b_EQF, down_a_EHQ, down_b_EQD; B times its scale) of PEFT's LoRA on the block's
    HFExpertsHandle (PEFT's ParamWrappers around it, one per parameter), or None: no wrapper, adapters disabled or
    merged. One active adapter per parameter (PEFT's ParamWrapper supports one for target_parameters training)."""
    module = block._modules.get("experts")
    if module is None or type(module).__name__ != "ParamWrapper":
        return None
    factors_ = [None] * 4
    while type(module).__name__ == "ParamWrapper":
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if module.disable_adapters or module.merged or not adapters:
            module = module.base_layer
            continue
        if len(adapters) > 1:
            raise ValueError(f"moe_plugin: {len(adapters)} active LoRA adapters on the experts' {module.parameter_name} "
                             f"({adapters}); the swapped layer runs one at a time (set_adapter)")
        name = adapters[0]
        a, b = from_peft(module.lora_A[name].weight, module.lora_B[name].weight, module.num_experts)
        columns = module.get_base_layer().layer_columns(module.parameter_name)
        if columns is not None:
            b = b.index_select(-1, columns.to(b.device))
        first, second = PAIRS[module.parameter_name]
        factors_[first], factors_[second] = a, b * module.scaling[name]
        module = module.base_layer
    return None if factors_ == [None] * 4 else tuple(factors_)


def router_delta(block: nn.Module) -> Optional[torch.Tensor]:
    """s B A [E, D] of PEFT's LoRA on the block's HFRouterHandle (differentiable in A and B), or None: no wrapper,
    adapters disabled or merged."""
    for module in block._modules.values():
        if type(module).__name__ != "ParamWrapper" or not isinstance(module.get_base_layer(), HFRouterHandle):
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if module.disable_adapters or module.merged or not adapters:
            return None
        if len(adapters) > 1:
            raise ValueError(f"moe_plugin: {len(adapters)} active LoRA adapters on the router ({adapters}); the "
                             f"swapped layer runs one at a time (set_adapter)")
        name = adapters[0]
        return module.lora_B[name].weight @ module.lora_A[name].weight * module.scaling[name]
    return None


@contextlib.contextmanager
def _router_weight(router: nn.Module, delta_ED: torch.Tensor):
    """Within it, router.weight_ED reads W + delta_ED (the parameter itself is untouched and gets its gradient)."""
    params = router._parameters
    weight_ED = params["weight_ED"]
    params["weight_ED"] = weight_ED + delta_ED.to(weight_ED.dtype)
    try:
        yield
    finally:
        params["weight_ED"] = weight_ED


@contextlib.contextmanager
def _router_adapted(router: nn.Module, delta_ED: torch.Tensor):
    """Within it, the router's own forward computes with W + delta_ED: the weight changes only between its forward
    hooks (after hosts' hooks gathered or unsharded it), and a router with hooks takes the reference route path, which
    reads router.weight_ED."""
    if hasattr(router.weight_ED, "ds_id"):
        raise ValueError("moe_plugin: PEFT's LoRA on the router of a swapped block under DeepSpeed ZeRO-3 is not "
                         "supported (its partitioned weight cannot take the adapter); adapt the experts only, or "
                         "use ZeRO-1/2 or FSDP2")
    active = []

    def enter(module, args):
        active.append(_router_weight(module, delta_ED))
        active[-1].__enter__()

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)
    handles = [router.register_forward_pre_hook(enter), router.register_forward_hook(leave)]
    try:
        yield
    finally:
        while active:
            active.pop().__exit__(None, None, None)
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def peft_adapters_in(block: nn.Module):
    """Within it, the block's layer computes with PEFT's factors (peft_adapters), as its experts' LoRA factors, and
    its router with PEFT's LoRA on the router (router_delta). It gives router_weight(): a context in which reading
    the router's weight_ED directly (the block's router-logits tap) sees the adapted weight too."""
    with contextlib.ExitStack() as stack:
        delta_ED = router_delta(block)
        router_weight = contextlib.nullcontext
        if delta_ED is not None:
            router = block.moe.router
            stack.enter_context(_router_adapted(router, delta_ED))
            router_weight = lambda: _router_weight(router, delta_ED)   # noqa: E731
        lora = peft_adapters(block)
        if lora is None:
            yield router_weight
            return
        experts = block.moe.experts
        if getattr(experts, "lora", None) is not None:
            raise ValueError("moe_plugin: the swapped experts hold an adapter of moe_plugin.lora (add_lora) and PEFT's "
                             "LoRA on mlp.experts at once; use one of them")
        experts.lora = lora
        try:
            yield router_weight
        finally:
            del experts.lora


def is_peft_model(model: nn.Module) -> bool:
    return type(model).__module__.split(".")[0] == "peft"


def detach_wrappers(hf_block: nn.Module):
    """PEFT's ParamWrappers around an HF block's children (its experts, its router), taken off it (the children are
    HF's own again), as {child name: (outermost, innermost)}; None without any."""
    found = {}
    for name, outer in list(hf_block._modules.items()):
        if type(outer).__name__ != "ParamWrapper":
            continue
        inner = outer
        while type(inner.base_layer).__name__ == "ParamWrapper":
            inner = inner.base_layer
        setattr(hf_block, name, inner.base_layer)
        found[name] = (outer, inner)
    return found or None


def attach_wrappers(block: nn.Module, wrappers) -> None:
    """Puts detach_wrappers' wrappers around a swapped block's HF-named handles (same names, same shapes)."""
    for name, (outer, inner) in (wrappers or {}).items():
        handle = block._modules.get(name)
        if name == "experts":
            if not isinstance(handle, HFExpertsHandle):
                raise TypeError(f"swap_moe_blocks: PEFT's LoRA targets HF's experts, but the swapped "
                                f"{type(block).__name__} has no HF-named experts to carry it (expert modules, or a "
                                f"family without fused experts)")
            held = handle.hf_names()
        elif isinstance(handle, HFRouterHandle):
            held = {"weight": None}
        else:
            raise TypeError(f"swap_moe_blocks: PEFT's LoRA targets the HF block's {name}, which the swapped "
                            f"{type(block).__name__} does not carry (it carries PEFT's LoRA on the experts and on the "
                            f"router's weight)")
        module = outer
        while True:
            if module.parameter_name not in held:
                raise ValueError(f"swap_moe_blocks: PEFT's LoRA targets {name}.{module.parameter_name}, which the "
                                 f"swapped layer does not hold (it holds {sorted(held)})")
            if module is inner:
                break
            module = module.base_layer
        inner.base_layer = handle
        setattr(block, name, outer)
