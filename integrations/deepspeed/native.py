"""The native layer: `MoE`, a deepspeed.moe.layer.MoE running moe_plugin's layer, and `swap_moe_layers`,
which applies a "moe" section to a model's native MoE layers.

`MoE` is a deepspeed.moe.layer.MoE (the engine, ZeRO 0-2, its gradient reduction and its checkpoints
treat it as a native MoE layer) whose `deepspeed_moe` is an MoELayer.

The adapter only translates: DeepSpeed's arguments -> one MoEConfig (`moe_config`). DeepSpeed's gating
maps onto it as: fixed capacity max(ceil(k * cf * T / E), min_capacity), drop_tokens=False -> dropless,
choice-major slots (all first choices before any second choice, as top2gating's offsets), top-1 gates
are the raw softmax score, top-k gates are renormalized over the choices kept after dropping, l_aux
is the GShard loss over first choices (k <= 2; over all k choices / k for k > 2).

Checkpoints: the layer's state dict uses the native names (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.<i>.<linear>.weight|bias`, Linear layout [out, in]; any other
expert module: `...deepspeed_experts.<i>.<its own names>`) through a
state-dict hook pair, so DeepSpeed's save_checkpoint writes every rank's experts to its per-expert
files and a native checkpoint loads into this backend (and back).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.layer import MoE as NativeMoE
from deepspeed.moe.utils import is_moe_param
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.experts import ACTIVATIONS as ACTIVATION_FUNCTIONS
from moe_plugin.experts import WEIGHT_NAMES as EXPERT_NAMES
from moe_plugin.experts import Experts, short_name
from moe_plugin.module_experts import ModuleExperts
from moe_plugin.parallel.groups import ExpertGroups, ExpertLayout, build_groups
from moe_plugin.integrations.deepspeed.section import (SECTION_TO_ARGUMENT, _is_int, check_ep_size_under_deepspeed,
                                                       section_key)

__all__ = ["MoE", "DeepSpeedMoELayer", "moe_config", "swap_moe_layers"]

ACTIVATIONS = {nn.ReLU: "relu", nn.GELU: "gelu", nn.SiLU: "silu", nn.Identity: "identity"}
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
NOISE_POLICIES = (None, "None", "Jitter", "RSample")   # DeepSpeed's noisy_gate_policy values
NATIVE_GATE_KEYS = ("k", "capacity_factor", "eval_capacity_factor", "min_capacity", "drop_tokens")


def moe_config(model_dim: int, hidden_size: int, num_experts: int, ep_size: int, k: int, capacity_factor: float,
               eval_capacity_factor: float, min_capacity: int, drop_tokens: bool, activation: str, bias: bool,
               router: str = "softmax", aux_loss_coef: float = 0.01, parallel=1,
               overlap_degree=1, a2a: str = "flat", node_size: Optional[int] = None,
               expert_bias_update_rate: float = 0.0, num_groups: int = 1, topk_groups: int = 1,
               route_scale: float = 1.0, aux_loss: Optional[str] = None, recompute: str = "none",
               aux_loss_scope: str = "local", redundant_experts=0) -> MoEConfig:
    """DeepSpeed's MoE settings as the one MoEConfig that routes like deepspeed.moe (see the module doc).

    The routing extras (balancing bias, groups, route scale, aux_loss) are moe_plugin's; aux_loss None
    follows DeepSpeed (gshard for k <= 2, switch above)."""
    return MoEConfig(
        model_dim=model_dim, hidden_size=hidden_size, num_experts=num_experts, top_k=k,
        capacity_factor=float(capacity_factor) if drop_tokens else 0.0,
        eval_capacity_factor=float(eval_capacity_factor) if drop_tokens else 0.0,
        min_capacity=min_capacity, router=router, gate_noise=0.0, fp32_router=True,
        normalize_gate="none" if k == 1 else "after_drop", batch_prioritized_routing=False,
        aux_loss=aux_loss or ("gshard" if k <= 2 else "switch"), aux_loss_coef=float(aux_loss_coef), z_loss_coef=0.0,
        activation=activation, bias=bias, ep_size=ep_size, parallel=parallel, overlap_degree=overlap_degree,
        a2a=a2a, node_size=node_size, expert_bias_update_rate=expert_bias_update_rate, num_groups=num_groups,
        topk_groups=topk_groups, route_scale=route_scale, recompute=recompute, aux_loss_scope=aux_loss_scope,
        redundant_experts=redundant_experts)


def _expert_structure(expert: nn.Module, model_dim: int, activation: Optional[str]):
    """(linear names, hidden size, activation, bias) of an expert Linear(D, H) -> act -> Linear(H, D), the
    fast path; None for any other module, the general path (moe_plugin/module_experts.py).

    Without activation=, the expert must hold two Linears, at most one activation module (ReLU, exact
    GELU, SiLU, Identity; none is identity) and nothing else, and compute linear2(act(linear1(x))) on
    random rows (a module's own forward may do more). With it, the two Linears are trusted."""
    linears = [(name, m) for name, m in expert.named_modules() if isinstance(m, nn.Linear)]
    linear_params = sum(len(list(m.parameters())) for _, m in linears)
    fits = len(linears) == 2 and linear_params == len(list(expert.parameters()))
    if fits:
        (first_name, first), (second_name, second) = linears
        fits = (first.in_features, second.out_features, first.out_features) == \
            (model_dim, model_dim, second.in_features) and (first.bias is None) == (second.bias is None)
    if activation is not None:
        if not fits:
            raise ValueError(f"activation={activation!r} asks for the fast path, which needs an expert "
                             f"Linear({model_dim}, H) -> activation -> Linear(H, {model_dim}), both with or without "
                             f"a bias; got {type(expert).__name__} with linears {[n for n, _ in linears]}; leave "
                             f"activation=None to run any other module on the general path")
        return (first_name, second_name), first.out_features, activation, first.bias is not None
    if not fits:
        return None
    others = [m for m in expert.modules() if m is not expert and not isinstance(m, nn.Linear)
              and type(m) not in CONTAINERS]
    if len(others) > 1 or any(type(m) not in ACTIVATIONS or getattr(m, "approximate", "none") != "none"
                              for m in others):
        return None
    activation = ACTIVATIONS[type(others[0])] if others else "identity"
    if not _computes_mlp(expert, first, others, second, activation):
        return None
    return (first_name, second_name), first.out_features, activation, first.bias is not None


def _computes_mlp(expert: nn.Module, first: nn.Linear, act: List[nn.Module], second: nn.Linear,
                  activation: str) -> bool:
    """Whether expert(x) is second(act(first(x))) on random rows; without weights to run (meta device,
    partitioned by ZeRO-3), whether the expert is an nn.Sequential of exactly those modules in order."""
    if first.weight.is_meta or first.weight.numel() == 0 or second.weight.numel() == 0:
        return type(expert) is nn.Sequential and list(expert) == [first, *act, second]
    x = torch.randn(4, first.in_features, dtype=first.weight.dtype, device=first.weight.device)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        want = second(ACTIVATION_FUNCTIONS[activation](first(x)))
        got = expert(x)
    return torch.is_tensor(got) and got.shape == want.shape and bool(
        (got - want).abs().max() <= 1e-3 * want.abs().max() + 1e-6)


def copy_expert_weights(experts: Experts, expert: nn.Module, linear_names: Tuple[str, str]) -> None:
    """Every local expert (its hidden slice, when sliced) starts as a copy of the module's two Linears, as
    DeepSpeed's Experts deep-copies the module. Weights partitioned by deepspeed.zero.Init are gathered for
    the copy; on the meta device there is nothing to copy (reset_parameters draws them later)."""
    first, second = (expert.get_submodule(name) for name in linear_names)
    sources = [p for p in (first.weight, first.bias, second.weight, second.bias) if p is not None]
    targets = list(experts.parameters())
    if any(t.is_meta for t in sources + targets):
        return
    gathered = contextlib.nullcontext()
    if any(hasattr(t, "ds_id") for t in sources + targets):
        gathered = deepspeed.zero.GatheredParameters(sources + targets, modifier_rank=0)
    with gathered, torch.no_grad():
        whole = {"w1": first.weight.t(), "w2": second.weight.t()}
        if first.bias is not None:
            whole.update(b1=first.bias, b2=second.bias)
        shard = Experts.take_slice(whole, experts.slices, experts.slice_index)
        for name in EXPERT_NAMES:
            param, key = getattr(experts, name), short_name(name)
            if param is None:
                continue
            if tuple(param.shape[1:]) != tuple(shard[key].shape):
                raise ValueError(f"expert module {type(expert).__name__}: its {key[0]} weight of shape "
                                 f"{tuple(shard[key].shape)} does not fit the experts' {tuple(param.shape[1:])} "
                                 f"(activation={experts.config.activation!r}); pass an activation that takes "
                                 f"Linear(D, H) -> Linear(H, D) (relu, gelu, silu, identity)")
            param.copy_(shard[key].expand_as(param))


def _ensure_distributed() -> None:
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def _expert_parallel_group(ep_size: int, tensor_parallel: bool = False):
    """DeepSpeed's expert-parallel group "ep_size_<ep_size>" of this rank (created, with its expert-data
    groups, when absent: every rank must build the layers in the same order). tensor_parallel: with DeepSpeed's
    mpu, as DeepSpeed's layer makes them with enable_expert_tensor_parallelism (ranks of one tensor-parallel
    rank)."""
    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        _ensure_distributed()
        if tensor_parallel and groups.mpu is not None:
            _check_ep_size_under_tensor_parallelism(ep_size)
            groups._create_expert_data_and_model_parallel(ep_size, mpu=groups.mpu)
        else:
            groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_group(name)


def _check_ep_size_under_tensor_parallelism(ep_size: int) -> None:
    """With expert tensor parallelism DeepSpeed splits the data-parallel processes (the processes / the
    tensor-parallel size) into expert-parallel groups: a ValueError naming the sizes, before its bare AssertionError."""
    data = groups.mpu.get_data_parallel_world_size() if hasattr(groups.mpu, "get_data_parallel_world_size") else None
    if data is not None and data % ep_size:
        raise ValueError(f"ep_size={ep_size} with enable_expert_tensor_parallelism=True must divide the data-parallel "
                         f"processes of DeepSpeed's mpu ({data}, with tensor-parallel size "
                         f"{bwc_tensor_model_parallel_world_size(groups.mpu)}); use an ep_size that divides {data}")


class DeepSpeedMoELayer(MoELayer):
    """An MoELayer standing where DeepSpeed's MOELayer stands (`MoE.deepspeed_moe`).

    forward(x, used_token) -> y, and keeps .l_aux (DeepSpeed's unweighted balance loss) and .exp_counts
    (choices per expert before dropping) as MOELayer does. Its state dict uses the native names.
    """

    def __init__(self, config: MoEConfig, ep_group, linear_names: Optional[Tuple[str, str]], group_name: str,
                 expert: Optional[nn.Module] = None):
        """expert: run on the general path (linear_names None); else the fast path's linears' names."""
        super().__init__(config, ep_group=ep_group, expert=expert)
        self.linear_names = linear_names
        self.experts.__class__ = NativeStackedExperts if expert is None else NativeModuleExperts
        self.experts.linear_names = linear_names
        self._used_T: Optional[torch.Tensor] = None   # during a forward with used_token: the used tokens
        self.tp_group = None                           # expert tensor parallelism (bind_tensor_parallel_group)
        self.group_pending = config.ep_size > 1 and not self.is_parallel   # see bind_expert_parallel_group
        for param in self.experts.parameters():
            param.allreduce = False
            param.group_name = group_name
        self.l_aux = torch.zeros(())
        self.exp_counts = torch.zeros(config.num_experts, dtype=torch.long)
        self.router.register_forward_hook(self._keep_balance_loss)
        self.register_state_dict_post_hook(_to_native_names)
        self.register_load_state_dict_pre_hook(_from_native_names)

    def bind_expert_parallel_group(self, ep_group) -> None:
        """The expert-parallel group of a layer built before it was known (given ExpertGroups without one, see
        MoE): its sub-groups (collective: every rank binds its layers in the same order), this rank's place among
        the experts and the tuner. The weights stay: the layout decides only which experts these are."""
        cfg = self.config
        self.groups = build_groups(cfg.num_experts, cfg.hidden_size, cfg.ep_size, cfg.node_size, ep_group)
        assert self.groups.layout.slices == 1, "MoE checks that ep_size divides num_experts"
        self.experts.first_expert = self.groups.layout.first_expert
        self.tuner = self._make_tuner()
        self.group_pending = False

    def bind_tensor_parallel_group(self) -> None:
        """Expert tensor parallelism: the fast path's experts are this rank's hidden slices (the module given is
        the slice, as DeepSpeed's own layer takes it), and the tensor-parallel ranks' partial outputs are summed.
        Nothing to do without DeepSpeed's mpu, with a tensor-parallel size of 1, or on the general path (there the
        module does its own tensor-parallel communication, e.g. Megatron's parallel linears, as under DeepSpeed)."""
        tp = bwc_tensor_model_parallel_world_size(groups.mpu)
        if tp == 1 or self.linear_names is None:
            return
        self.tp_group = bwc_tensor_model_parallel_group(groups.mpu)

    def _keep_balance_loss(self, router, inputs, routes):
        if self.tp_group is not None:   # each tensor-parallel rank gives the gates a part of their gradient
            routes.gate_TK = _CopyToTensorParallel.apply(routes.gate_TK, self.tp_group)
        if self._used_T is not None:   # top-1 with used_token: only used tokens count as routed (top1gating)
            used_T = self._used_T
            first_E = torch.zeros(self.config.num_experts, dtype=torch.long, device=used_T.device).index_add_(
                0, routes.expert_TK[:, 0], used_T.to(torch.long))
            probs_TE = routes.scores_TE
            if self.config.router in ("sigmoid", "sqrt_softplus"):
                probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True).clamp(min=torch.finfo(probs_TE.dtype).tiny)
            if self.config.aux_loss != "none":
                routes.aux_loss = self.config.num_experts * (probs_TE.mean(0) * first_E / max(len(used_T), 1)).sum()
            self._used_counts = first_E
        self.l_aux = routes.aux_loss

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.group_pending:
            raise ValueError(f"enable_expert_tensor_parallelism=True with ep_size={self.config.ep_size}: the layer has "
                             f"no expert-parallel group yet (it joins ranks of one tensor-parallel rank, known from "
                             f"DeepSpeed's mpu): run it under deepspeed.initialize(..., mpu=mpu), which binds it, or "
                             f"set deepspeed.utils.groups.mpu = mpu before its first forward")
        if used_token is not None and self.config.top_k > 1:
            _warn_used_token_ignored(self.config.top_k)   # as DeepSpeed's top-2 and top-k gates
            used_token = None
        if used_token is None:
            y = self._forward(x)
            self.exp_counts = self._routing[0].to(torch.long)   # on the device: no host synchronization
            return y
        return self._forward_used(x, used_tokens(used_token, x, self.config))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """MoELayer's forward; with expert tensor parallelism, the sum of the tensor-parallel ranks' outputs
        (each from its hidden slices; the ranks hold the same tokens and route alike), gradients summed where the
        ranks' parts meet: the expert input and the gates."""
        if self.tp_group is None:
            return super().forward(x)
        y = super().forward(_CopyToTensorParallel.apply(x, self.tp_group), router_input=x)
        return _SumOverTensorParallel.apply(y, self.tp_group)

    def _forward_used(self, x: torch.Tensor, used_T: torch.Tensor) -> torch.Tensor:
        """Top-1 with tokens masked out of routing (DeepSpeed's used_token): the used tokens go first, in order,
        so they take the slots DeepSpeed gives them (the capacity still counts every token); the others are
        routed after them and their outputs zeroed; l_aux and exp_counts count used tokens only."""
        order_T = torch.argsort((~used_T).to(torch.int8), stable=True)
        x_TD = x.reshape(-1, self.config.model_dim).index_select(0, order_T)
        self._used_T = used_T.index_select(0, order_T)
        try:
            y_TD = self._forward(x_TD) * self._used_T.unsqueeze(-1).to(x_TD.dtype)
        finally:
            self._used_T = None
        self.exp_counts = self._used_counts
        return y_TD.new_empty(y_TD.shape).index_copy(0, order_T, y_TD).view(x.shape[:-1] + (self.config.model_dim,))


class _CopyToTensorParallel(torch.autograd.Function):
    """The same tensor on every tensor-parallel rank: identity forward, gradients summed over the ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTensorParallel(torch.autograd.Function):
    """The sum of the tensor-parallel ranks' partial outputs; each rank's part gets the whole gradient."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        torch.distributed.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def used_tokens(used_token: torch.Tensor, x: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """DeepSpeed's used_token (1 routes the token, 0 masks it out; one per token, flat or x's leading shape)
    as a bool [T], checked."""
    tokens = x.numel() // config.model_dim
    if not torch.is_tensor(used_token) or used_token.numel() != tokens or \
            used_token.shape not in (torch.Size([tokens]), x.shape[:-1]):
        got = tuple(used_token.shape) if torch.is_tensor(used_token) else type(used_token).__name__
        raise ValueError(f"used_token must be a tensor of one 0/1 value per token, shape ({tokens},) or "
                         f"{tuple(x.shape[:-1])}; got {got}")
    used_T = used_token.reshape(-1).to(x.device)
    if used_T.dtype != torch.bool:
        if not bool(((used_T == 0) | (used_T == 1)).all()):
            raise ValueError("used_token must hold 0 (token masked out of routing) or 1 (routed) only")
        used_T = used_T != 0
    if config.aux_loss == "seq":
        raise ValueError("used_token is not supported with aux_loss 'seq' (its sequences are the input's rows); "
                         "use aux_loss 'gshard' or 'switch'")
    return used_T


@functools.lru_cache(maxsize=None)
def _warn_used_token_ignored(k: int) -> None:
    warnings.warn(f"used_token is ignored with k={k}, as DeepSpeed's top-{k} gate ignores it; it masks tokens "
                  f"out of routing with k=1 only", stacklevel=4)


class _ExpertPath:
    """A read-only view of one stacked expert as the module it was built from: `view[0].weight` (nn.Sequential)
    or `view.fc1.weight` (named Linears) is that Linear's weight, [out, in] as nn.Linear keeps it; a view into
    the stacked tensors (experts.w1_EDH[i] and so on), so it always reads the current values."""

    def __init__(self, experts: "NativeStackedExperts", index: int, prefix: str = ""):
        object.__setattr__(self, "_where", (experts, index, prefix))

    def _child(self, name):
        experts, index, prefix = self._where
        key = prefix + str(name)
        first, second = experts.linear_names
        if key in (first, second):
            return _LinearView(experts, index, key == first)
        if any(n.startswith(key + ".") for n in (first, second)):
            return _ExpertPath(experts, index, key + ".")
        raise AttributeError(f"expert {index} has no Linear {key!r}; its Linears are {first!r} and {second!r} "
                             f"(stacked in deepspeed_moe.experts.{EXPERT_NAMES[0]} / {EXPERT_NAMES[2]})")

    __getitem__ = _child

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._child(name)

    def __setattr__(self, name, value):
        raise AttributeError(_READ_ONLY)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        experts, index, prefix = self._where
        state = {}
        for name in experts.linear_names:
            if name.startswith(prefix):
                linear = _LinearView(experts, index, name == experts.linear_names[0])
                state[f"{name[len(prefix):]}.weight"] = linear.weight.detach()
                if linear.bias is not None:
                    state[f"{name[len(prefix):]}.bias"] = linear.bias.detach()
        return state


_READ_ONLY = ("deepspeed_experts is a read-only view of the stacked expert weights (deepspeed_moe.experts.{} "
              "[E_local, D, H], {}, {} [E_local, H, D], {}): change those parameters instead").format(*EXPERT_NAMES)


class _LinearView:
    """weight and bias: views into the stacked parameters, with .grad the matching slice of theirs, if any; under
    ZeRO 1/2 (gradients and fp32 weights in the optimizer) DeepSpeed's safe_get_full_grad, safe_get_full_fp32_param
    and safe_get_full_optimizer_state give the matching slice of the stacked parameter's (collectives over its
    data-parallel group, as for any parameter); DeepSpeed's setters refuse the view (AttributeError)."""

    def __init__(self, experts, index: int, first: bool):
        names = EXPERT_NAMES[:2] if first else EXPERT_NAMES[2:]
        weight, bias = (getattr(experts, n) for n in names)
        object.__setattr__(self, "weight", _view(weight, index))
        object.__setattr__(self, "bias", None if bias is None else _view(bias, index))

    def __setattr__(self, name, value):
        raise AttributeError(_READ_ONLY)


def _view(stacked: torch.Tensor, index: int) -> torch.Tensor:
    """Expert index of a stacked tensor as nn.Linear keeps it ([out, in]), its gradient attached; with the stacked
    parameter's ZeRO 1/2 mapping (DeepSpeed's link_hp_params: _hp_mapping, None on ranks whose partition lacks
    it), the full-gradient and fp32 readers DeepSpeed's safe_get_full_* call, each giving this expert's slice."""
    def pick(tensor):
        return tensor[index].t() if stacked.dim() == 3 else tensor[index]

    view = pick(stacked)
    if stacked.grad is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # .grad of a non-leaf tensor
            view.grad = pick(stacked.grad)
    if hasattr(stacked, "_hp_mapping"):
        view._hp_mapping = stacked._hp_mapping
        view.get_full_hp_grad = lambda: pick(stacked.get_full_hp_grad())
        view.get_full_hp_param = lambda optim_state_key=None: pick(stacked.get_full_hp_param(optim_state_key))
        view.set_full_hp_grad = view.set_full_hp_param = _refuse_write
    return view


def _refuse_write(*args):
    raise AttributeError(_READ_ONLY)


class NativeStackedExperts(Experts):
    """The fast path's stacked experts, plus DeepSpeed's `deepspeed_experts`: per local expert, a read-only
    view shaped as the module the experts were built from (see _ExpertPath)."""

    linear_names: Tuple[str, str]

    @property
    def deepspeed_experts(self) -> List[_ExpertPath]:
        return [_ExpertPath(self, i) for i in range(self.w1_EDH.shape[0])]


class NativeModuleExperts(ModuleExperts):
    """The general path's experts, plus DeepSpeed's `deepspeed_experts`: the local experts' modules themselves."""

    @property
    def deepspeed_experts(self) -> nn.ModuleList:
        return self.local


def _native_expert_names(layer: DeepSpeedMoELayer) -> Dict[str, str]:
    """Stacked expert tensor -> its name inside one native expert (Linear weights are [out, in])."""
    first, second = layer.linear_names
    return dict(zip(EXPERT_NAMES, (f"{first}.weight", f"{first}.bias", f"{second}.weight", f"{second}.bias")))


def _to_native_names(layer: DeepSpeedMoELayer, state: Dict[str, Any], prefix: str, local_metadata) -> None:
    """router.weight_ED -> gate.wg.weight; stacked experts -> experts.deepspeed_experts.<i>.<linear>.*

    The balancing bias stays only when it is on (the native layer has none, and a missing one loads as
    zeros), as router.Expert_bias_E (see hide_from_expert_files). Under ZeRO-3 (parameters partitioned: the layer
    is no DeepSpeed MoE there, see zero3.py) the names stay the parameters' own, as zero_to_fp32 gives them."""
    if any(hasattr(param, "ds_id") for param in layer.experts.parameters()):
        return
    state[prefix + "gate.wg.weight"] = state.pop(prefix + "router.weight_ED")
    if layer.config.expert_bias_update_rate == 0:
        state.pop(prefix + "router.expert_bias_E", None)
    hide_from_expert_files(state, prefix, "experts.")
    if not layer.experts.stacked:   # experts.local.<i>.<name> -> experts.deepspeed_experts.<i>.<name>
        _rename_prefix(state, prefix + "experts.local.", prefix + "experts.deepspeed_experts.")
        return
    stacked = {name: state.pop(prefix + "experts." + name) for name in EXPERT_NAMES
               if prefix + "experts." + name in state}
    native = _native_expert_names(layer)
    for i in range(layer.groups.layout.local_experts):
        for name, tensor in stacked.items():
            state[f"{prefix}experts.deepspeed_experts.{i}.{native[name]}"] = tensor[i].t() if tensor.dim() == 3 \
                else tensor[i]


def hide_from_expert_files(state: Dict[str, Any], prefix: str, experts_prefix: str) -> None:
    """Rename "expert" to "Expert" in a layer's keys outside experts_prefix (the balancing bias).

    engine.save_checkpoint files every key of an MoE layer holding "expert" under an expert index read
    from the key, and fails on one without (DeepSpeed 0.19.8, _save_moe_checkpoint)."""
    for key in [k for k in state if k.startswith(prefix) and "expert" in k[len(prefix):]
                and not k.startswith(prefix + experts_prefix)]:
        state[prefix + key[len(prefix):].replace("expert", "Expert")] = state.pop(key)


def unhide_from_expert_files(state: Dict[str, Any], prefix: str) -> None:
    for key in [k for k in state if k.startswith(prefix) and "Expert" in k[len(prefix):]]:
        state[prefix + key[len(prefix):].replace("Expert", "expert")] = state.pop(key)


def _from_native_names(layer: DeepSpeedMoELayer, state: Dict[str, Any], prefix: str, *args) -> None:
    """The inverse of _to_native_names (a tensor is stacked only when every local expert has it)."""
    unhide_from_expert_files(state, prefix)
    if prefix + "gate.wg.weight" in state:
        state[prefix + "router.weight_ED"] = state.pop(prefix + "gate.wg.weight")
    if not layer.experts.stacked:
        _rename_prefix(state, prefix + "experts.deepspeed_experts.", prefix + "experts.local.")
        return
    native = _native_expert_names(layer)
    for name in EXPERT_NAMES:
        keys = [f"{prefix}experts.deepspeed_experts.{i}.{native[name]}"
                for i in range(layer.groups.layout.local_experts)]
        if all(key in state for key in keys):
            tensors = [state.pop(key) for key in keys]
            state[f"{prefix}experts.{name}"] = torch.stack([t.t() if t.dim() == 2 else t for t in tensors])


def _rename_prefix(state: Dict[str, Any], old: str, new: str) -> None:
    for key in [k for k in state if k.startswith(old)]:
        state[new + key[len(old):]] = state.pop(key)


class MoE(NativeMoE):
    """deepspeed.moe.layer.MoE running moe_plugin's router, dispatch, experts and all-to-all.

    Takes deepspeed.moe.layer.MoE's arguments (the expert: any module; Linear(D, H) -> activation ->
    Linear(H, D) runs on the fast path, see _expert_structure) plus this project's extras (keyword only). forward(x, used_token=None) -> (output, l_aux, exp_counts)
    like the native layer; aux_loss_coef weights only .deepspeed_moe.aux_loss (moe_plugin.aux_loss(model)),
    never the returned l_aux. ep_size > 1 needs torch.distributed (or deepspeed.init_distributed()) first.

    Every expert starts as a copy of `expert` (the fast path copies its Linears). noisy_gate_policy "Jitter" /
    "RSample" and used_token (k = 1) act as in DeepSpeed; enable_expert_tensor_parallelism: see
    DeepSpeedMoELayer.bind_tensor_parallel_group; at ep_size > 1 its expert-parallel group (ranks of one
    tensor-parallel rank) is bound as soon as DeepSpeed's mpu is known: when built, when the engine calls
    set_deepspeed_parallelism, or at the first forward (a ValueError if still unknown). Not expressible here (see README): use_rts=True (over-capacity
    tokens are dropped by position instead of at random) and top2_2nd_expert_sampling=True (the second expert is
    the plain second best); both warn.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, activation: Optional[str] = None,
                 router: str = "softmax", aux_loss_coef: float = 0.01, parallel=1, overlap_degree=1,
                 a2a: str = "flat", node_size: Optional[int] = None, expert_bias_update_rate: float = 0.0,
                 num_groups: int = 1, topk_groups: int = 1, route_scale: float = 1.0,
                 aux_loss: Optional[str] = None, recompute: str = "none", aux_loss_scope: str = "local",
                 redundant_experts=0) -> None:
        # nn.Module's init, not the native one: that one deep-copies `expert` per local expert
        nn.Module.__init__(self)
        if noisy_gate_policy not in NOISE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r} is invalid; allowed: "
                             f"{', '.join(map(repr, NOISE_POLICIES))}")
        if enable_expert_tensor_parallelism not in (True, False):
            raise ValueError(f"enable_expert_tensor_parallelism={enable_expert_tensor_parallelism!r} is invalid; "
                             f"allowed: True, False")
        if not _is_int(num_experts, 1) or not _is_int(ep_size, 1) or num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be a multiple of ep_size={ep_size} (both integers >= 1)")
        if ep_size > 1:   # before DeepSpeed's groups fail with a bare AssertionError
            _ensure_distributed()
            check_ep_size_under_deepspeed(ep_size, "ep_size")
        if not _is_int(k, 1) or k > num_experts:
            raise ValueError(f"k={k} is invalid: must be an integer between 1 and num_experts={num_experts}")
        self.settings = dict(hidden_size=hidden_size, num_experts=num_experts, ep_size=ep_size, k=k,
                             capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
                             min_capacity=min_capacity, use_residual=use_residual,
                             noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens, use_rts=use_rts,
                             use_tutel=use_tutel, enable_expert_tensor_parallelism=enable_expert_tensor_parallelism,
                             top2_2nd_expert_sampling=top2_2nd_expert_sampling, activation=activation, router=router,
                             aux_loss_coef=aux_loss_coef, parallel=parallel, overlap_degree=overlap_degree, a2a=a2a,
                             node_size=node_size, expert_bias_update_rate=expert_bias_update_rate,
                             num_groups=num_groups, topk_groups=topk_groups, route_scale=route_scale,
                             aux_loss=aux_loss, recompute=recompute, aux_loss_scope=aux_loss_scope,
                             redundant_experts=redundant_experts)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size

        structure = _expert_structure(expert, hidden_size, activation)
        if structure is None and any(hasattr(p, "ds_id") for p in expert.parameters()):
            raise ValueError(f"expert module {type(expert).__name__} runs on the general path (each expert a copy of "
                             f"the module), which cannot copy parameters partitioned by deepspeed.zero.Init; build "
                             f"the model outside deepspeed.zero.Init (ZeRO-3 partitions it in initialize)")
        # the general path (structure None) reads neither hidden size, activation nor bias
        linear_names, expert_hidden, activation, bias = structure or (None, hidden_size, "identity", False)
        if use_rts and drop_tokens and k == 1:
            warnings.warn("backend tutel drops over-capacity tokens by position, not by DeepSpeed's random token "
                          "selection (use_rts=True); pass use_rts=False to silence this", stacklevel=2)
        if top2_2nd_expert_sampling and k == 2:
            warnings.warn("backend tutel picks the plain second-best expert, without DeepSpeed's sampled second "
                          "expert (top2_2nd_expert_sampling=True); pass top2_2nd_expert_sampling=False to silence "
                          "this", stacklevel=2)
        config = moe_config(hidden_size, expert_hidden, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                            min_capacity, drop_tokens, activation, bias, router, aux_loss_coef, parallel,
                            overlap_degree, a2a, node_size, expert_bias_update_rate, num_groups, topk_groups,
                            route_scale, aux_loss, recompute, aux_loss_scope, redundant_experts)
        ep_group = None
        if ep_size > 1 and enable_expert_tensor_parallelism and not self._groups_known():
            # its expert-parallel group joins ranks of one tensor-parallel rank: bound when DeepSpeed's mpu is known
            ep_group = ExpertGroups(None, ExpertLayout(num_experts, config.hidden_size, ep_size, 0), 1)
        elif ep_size > 1:
            ep_group = _expert_parallel_group(ep_size, enable_expert_tensor_parallelism)
        self.deepspeed_moe = DeepSpeedMoELayer(config, ep_group, linear_names, self.expert_group_name,
                                               expert=None if structure else expert)
        if enable_expert_tensor_parallelism:
            self.deepspeed_moe.bind_tensor_parallel_group()
        if structure:   # the general path deep-copies the module; the fast path copies its Linears here
            copy_expert_weights(self.deepspeed_moe.experts, expert, linear_names)
        self.deepspeed_moe.router.noise_policy = _noise_policy(noisy_gate_policy, k)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def _groups_known(self) -> bool:
        """Whether DeepSpeed's mpu or this layer's expert-parallel group is known (DeepSpeed's layer binds the group
        when the engine calls set_deepspeed_parallelism; this one as soon as it is known)."""
        return groups.mpu is not None or self.expert_group_name in groups._get_expert_parallel_group_dict()

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        """deepspeed.moe.layer.MoE's forward; a layer built before its expert-parallel group was known binds it
        here once DeepSpeed knows it (else DeepSpeedMoELayer's forward says what is missing)."""
        if self.deepspeed_moe.group_pending and self._groups_known():
            self._bind_groups()
        return super().forward(hidden_states, used_token)

    def _bind_groups(self) -> None:
        group = _expert_parallel_group(self.ep_size, self.enable_expert_tensor_parallelism)
        if self.deepspeed_moe.group_pending:
            self.deepspeed_moe.bind_expert_parallel_group(group)
        if self.enable_expert_tensor_parallelism:
            self.deepspeed_moe.bind_tensor_parallel_group()

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by the engine: makes sure DeepSpeed's expert and expert-data groups exist, and binds them."""
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_=True is not supported by backend tutel; allowed: False")
        if not self.enable_expert_tensor_parallelism and groups.mpu is not None and \
                bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
            raise ValueError("backend tutel does not support tensor model parallelism (an mpu with tensor parallel "
                             "size > 1) without enable_expert_tensor_parallelism=True; use backend deepspeed")
        self._bind_groups()


def _noise_policy(noisy_gate_policy: Optional[str], k: int) -> Optional[str]:
    """The router's noise policy for DeepSpeed's noisy_gate_policy (None: none). "RSample" acts on top-1 only, as
    in DeepSpeed (its top-2 and top-k gates ignore it): with k > 1 it warns and adds nothing."""
    if noisy_gate_policy == "RSample" and k > 1:
        warnings.warn(f"noisy_gate_policy='RSample' has no effect with k={k}: DeepSpeed samples (and backend tutel "
                      f"samples) the top-1 choice only", stacklevel=3)
        return None
    return {"Jitter": "jitter", "RSample": "gumbel"}.get(noisy_gate_policy)


def _native_settings(moe: NativeMoE) -> Dict[str, Any]:
    gate = moe.deepspeed_moe.gate
    return dict(hidden_size=gate.wg.in_features, num_experts=moe.num_experts, ep_size=moe.ep_size, k=gate.k,
                capacity_factor=gate.capacity_factor, eval_capacity_factor=gate.eval_capacity_factor,
                min_capacity=gate.min_capacity, use_residual=moe.use_residual,
                noisy_gate_policy=gate.noisy_gate_policy, drop_tokens=gate.drop_tokens, use_rts=gate.use_rts,
                use_tutel=moe.deepspeed_moe.use_tutel,
                enable_expert_tensor_parallelism=moe.enable_expert_tensor_parallelism,
                top2_2nd_expert_sampling=gate.top2_2nd_expert_sampling)


def swap_moe_layers(model: nn.Module, section: Mapping[str, Any]) -> Tuple[nn.Module, Dict[int, List[nn.Parameter]]]:
    """Apply a validated "moe" section to every deepspeed.moe.layer.MoE in model.

    backend "tutel": each native layer is rebuilt as MoE with the section's settings, its weights loaded
    through the native names (a layer already ours must agree with the section). backend "deepspeed": the
    native gates take the section's top_k, capacity_factor, eval_capacity_factor, min_capacity and
    drop_tokens (router must be softmax; aux_loss_coef, parallel, overlap_degree, a2a, node_size are
    moe_plugin's and left out). Returns the model (new when the model itself was
    a layer) and {id(old parameter): its new parameters} for the rebuilt layers.
    """
    overrides = {SECTION_TO_ARGUMENT.get(key, key): value for key, value in section.items()
                 if key not in ("backend", "num_experts", "ep_size")}
    replaced: Dict[int, List[nn.Parameter]] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, NativeMoE):
            continue
        if hasattr(module, "check_swapped_block"):   # a Hugging Face block swapped before initialize (hf.py)
            module.check_swapped_block(name, section)
            continue
        where = f"MoE layer {name!r}" if name else "the MoE model"
        for key in ("num_experts", "ep_size"):
            if key in section and section[key] != getattr(module, key):
                raise ValueError(f"DeepSpeed config \"moe.{key}\"={section[key]} differs from {where} "
                                 f"({key}={getattr(module, key)}); the section must describe the model's layers")
        if section.get("top_k", 1) > module.num_experts:
            raise ValueError(f"DeepSpeed config \"moe.top_k\"={section['top_k']} is invalid for {where}: must be "
                             f"between 1 and its num_experts={module.num_experts}")
        if section["backend"] == "deepspeed":
            if isinstance(module, MoE):
                raise ValueError(f"\"moe.backend\": \"deepspeed\" but {where} is moe_plugin's layer; build the model "
                                 f"with deepspeed.moe.layer.MoE to run DeepSpeed's native layer")
            gate = module.deepspeed_moe.gate
            for key, value in overrides.items():
                if key in NATIVE_GATE_KEYS:
                    setattr(gate, key, value)
            continue
        if isinstance(module, MoE):
            for key, value in overrides.items():
                if module.settings[key] != value:
                    raise ValueError(f"DeepSpeed config \"moe.{section_key(key)}\"={value!r} differs from {where}, "
                                     f"built as moe_plugin's MoE with {key}={module.settings[key]!r}; build it with "
                                     f"the section's settings (or as deepspeed.moe.layer.MoE, which is rebuilt)")
            continue
        if any(hasattr(p, "ds_id") for p in module.parameters()):
            raise ValueError(f"{where} (deepspeed.moe.layer.MoE) was built under deepspeed.zero.Init, whose partitioned "
                             f"parameters its per-expert deep copies do not keep; build the model outside "
                             f"deepspeed.zero.Init (ZeRO-3 partitions it in initialize), or build it with "
                             f"moe_plugin.integrations.deepspeed.MoE, which may be built under zero.Init at ep_size 1")
        settings = {**_native_settings(module), **overrides}
        new = _rebuild(module, settings)
        replaced.update(_parameter_map(module, new))
        if name:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, new)
            funcs = getattr(parent, "forward_funcs", None)   # a PipelineModule calls its stage's layers from here
            if funcs is not None:
                funcs[:] = [new if f is module else f for f in funcs]
        else:
            model = new
    return model, replaced


def _rebuild(old: NativeMoE, settings: Dict[str, Any]) -> MoE:
    """Our layer with old's settings and weights (loaded through the native names)."""
    expert = old.mlp if old.use_residual else old.deepspeed_moe.experts.deepspeed_experts[0]
    any_param = next(old.parameters())
    new = MoE(expert=expert, **settings).to(device=any_param.device, dtype=any_param.dtype)
    if old.use_residual:
        new.mlp, new.coefficient = old.mlp, old.coefficient
    new.load_state_dict(old.state_dict())
    new.train(old.training)
    return new


def _parameter_map(old: nn.Module, new: nn.Module) -> Dict[int, List[nn.Parameter]]:
    """Old layer's parameters -> the new layer's: experts to experts, the rest (gate) to the rest."""
    kept = {id(p) for p in new.parameters()}
    fresh = [p for p in new.parameters() if id(p) not in {id(q) for q in old.parameters()}]
    fresh_experts = [p for p in fresh if is_moe_param(p)]
    fresh_shared = [p for p in fresh if not is_moe_param(p)]
    return {id(p): [p] if id(p) in kept else (fresh_experts if is_moe_param(p) else fresh_shared)
            for p in old.parameters()}
