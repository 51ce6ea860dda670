"""DeepSpeed backend: `"moe": {"backend": "tutel", ...}` in the DeepSpeed JSON runs moe_plugin's layer.

`MoE` is a deepspeed.moe.layer.MoE (the engine, ZeRO 0-2, its gradient reduction and its checkpoints
treat it as a native MoE layer) whose `deepspeed_moe` is an MoELayer. `initialize` has
deepspeed.initialize's signature: it reads the "moe" section, swaps every native MoE layer for this
one (weights carried over), builds the MoE optimizer groups and calls deepspeed.initialize.

The adapter only translates: DeepSpeed's arguments -> one MoEConfig (`moe_config`). DeepSpeed's gating
maps onto it as: fixed capacity max(ceil(k * cf * T / E), min_capacity), drop_tokens=False -> dropless,
choice-major slots (all first choices before any second choice, as top2gating's offsets), top-1 gates
are the raw softmax score, top-k gates are renormalized over the choices kept after dropping, l_aux
is the GShard loss over first choices (k <= 2; over all k choices / k for k > 2).

Checkpoints: the layer's state dict uses the native names (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.<i>.<linear>.weight|bias`, Linear layout [out, in]) through a
state-dict hook pair, so DeepSpeed's save_checkpoint writes every rank's experts to its per-expert
files and a native checkpoint loads into this backend (and back).
"""
from __future__ import annotations

import difflib
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
    from deepspeed.moe.layer import MoE as NativeMoE
    from deepspeed.moe.utils import configure_moe_param_groups, is_moe_param
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(f"moe_plugin.integrations.deepspeed needs DeepSpeed ({error}); "
                      f"install it with: pip install 'moe_plugin[deepspeed]'") from error

from moe_plugin import MoEConfig, MoELayer, update_expert_bias

__all__ = ["MoE", "initialize", "read_moe_section", "moe_config", "swap_moe_layers", "SECTION_KEYS"]

BACKENDS = ("tutel", "deepspeed")
ACTIVATIONS = {nn.ReLU: "relu", nn.GELU: "gelu", nn.SiLU: "silu"}
EXPERT_NAMES = ("w1_EDH", "b1_EH", "w2_EHD", "b2_ED")

NATIVE_GATE_KEYS = ("k", "capacity_factor", "eval_capacity_factor", "min_capacity", "drop_tokens")
SECTION_TO_ARGUMENT = {"top_k": "k"}   # section key -> MoE constructor argument, where they differ


def _is_int(value, minimum):
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value, positive):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    return ok and (value > 0 if positive else value >= 0)


# "moe" section key -> (check, what is allowed). Routing keys override every MoE layer's own setting.
SECTION_KEYS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "backend": (lambda v: v in BACKENDS, "\"tutel\" or \"deepspeed\""),
    "num_experts": (lambda v: _is_int(v, 1), "an integer >= 1 equal to every MoE layer's num_experts"),
    "ep_size": (lambda v: _is_int(v, 1), "an integer >= 1 equal to every MoE layer's ep_size"),
    "top_k": (lambda v: _is_int(v, 1), "an integer between 1 and num_experts"),
    "capacity_factor": (lambda v: _is_number(v, positive=True), "a number > 0"),
    "eval_capacity_factor": (lambda v: _is_number(v, positive=True), "a number > 0"),
    "min_capacity": (lambda v: _is_int(v, 0), "an integer >= 0"),
    "drop_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "router": (lambda v: v in ("softmax", "sigmoid", "cosine"),
               "\"softmax\", \"sigmoid\" or \"cosine\" (backend tutel; deepspeed has softmax only)"),
    "aux_loss_coef": (lambda v: _is_number(v, positive=False), "a number >= 0"),
    "parallel": (lambda v: v == "auto" or _is_int(v, 0), "\"auto\" or an integer >= 0"),
    "overlap_degree": (lambda v: v == "auto" or _is_int(v, 1), "\"auto\" or an integer >= 1"),
    "a2a": (lambda v: v in ("flat", "2dh"), "\"flat\" or \"2dh\""),
    "node_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "expert_bias_update_rate": (lambda v: _is_number(v, positive=False) and v != float("inf"),
                                "a finite number >= 0 (backend tutel)"),
    "num_groups": (lambda v: _is_int(v, 1), "an integer >= 1 dividing num_experts (backend tutel)"),
    "topk_groups": (lambda v: _is_int(v, 1), "an integer between 1 and num_groups (backend tutel)"),
    "route_scale": (lambda v: _is_number(v, positive=True) and v != float("inf"),
                    "a finite number > 0 (backend tutel)"),
    "aux_loss": (lambda v: v in ("gshard", "switch", "seq"), "\"gshard\", \"switch\" or \"seq\" (backend tutel)"),
}
TUTEL_ONLY_KEYS = ("expert_bias_update_rate", "num_groups", "topk_groups", "route_scale", "aux_loss")


def read_moe_section(config: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The validated "moe" section of a DeepSpeed config dict (None when there is none).

    Only the keys given are returned; "backend" is required.
    """
    section = config.get("moe")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"DeepSpeed config \"moe\" must be an object, got {type(section).__name__}")
    for key in section:
        if key not in SECTION_KEYS:
            close = difflib.get_close_matches(str(key), list(SECTION_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"DeepSpeed config \"moe\" has no key {key!r}{hint}; known keys: "
                             f"{', '.join(SECTION_KEYS)}")
    if "backend" not in section:
        raise ValueError("DeepSpeed config \"moe.backend\" is required: \"tutel\" (moe_plugin's layer) or "
                         "\"deepspeed\" (DeepSpeed's native layer)")
    for key, value in section.items():
        check, allowed = SECTION_KEYS[key]
        if not check(value):
            raise ValueError(f"DeepSpeed config \"moe.{key}\"={value!r} is invalid: must be {allowed}")
    if section["backend"] == "deepspeed" and section.get("router", "softmax") != "softmax":
        raise ValueError(f"DeepSpeed config \"moe.router\"={section['router']!r} needs \"moe.backend\": \"tutel\"; "
                         f"DeepSpeed's native gate is softmax")
    if section["backend"] == "deepspeed":
        for key in TUTEL_ONLY_KEYS:
            if key in section:
                raise ValueError(f"DeepSpeed config \"moe.{key}\"={section[key]!r} needs \"moe.backend\": "
                                 f"\"tutel\"; DeepSpeed's native gate has no {key}")
    return dict(section)


def moe_config(model_dim: int, hidden_size: int, num_experts: int, ep_size: int, k: int, capacity_factor: float,
               eval_capacity_factor: float, min_capacity: int, drop_tokens: bool, activation: str, bias: bool,
               router: str = "softmax", aux_loss_coef: float = 0.01, parallel=1,
               overlap_degree=1, a2a: str = "flat", node_size: Optional[int] = None,
               expert_bias_update_rate: float = 0.0, num_groups: int = 1, topk_groups: int = 1,
               route_scale: float = 1.0, aux_loss: Optional[str] = None) -> MoEConfig:
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
        topk_groups=topk_groups, route_scale=route_scale)


def _expert_structure(expert: nn.Module, model_dim: int, activation: Optional[str]):
    """(linear names, hidden size, activation, bias) of an expert Linear(D, H) -> act -> Linear(H, D)."""
    linears = [(name, m) for name, m in expert.named_modules() if isinstance(m, nn.Linear)]
    linear_params = sum(len(list(m.parameters())) for _, m in linears)
    example = "e.g. nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))"
    if len(linears) != 2 or linear_params != len(list(expert.parameters())):
        raise ValueError(f"backend tutel needs an expert made of two nn.Linear layers and an activation, {example}; "
                         f"got {type(expert).__name__} with linears {[n for n, _ in linears]}")
    (first_name, first), (second_name, second) = linears
    if (first.in_features, second.out_features, first.out_features) != (model_dim, model_dim, second.in_features):
        raise ValueError(f"backend tutel needs expert linears {model_dim} -> H -> {model_dim}; got "
                         f"{first_name}: {first.in_features} -> {first.out_features}, "
                         f"{second_name}: {second.in_features} -> {second.out_features}")
    if (first.bias is None) != (second.bias is None):
        raise ValueError("backend tutel needs both expert linears with a bias or both without")
    if activation is None:
        found = [ACTIVATIONS[type(m)] for m in expert.modules() if type(m) in ACTIVATIONS
                 and getattr(m, "approximate", "none") == "none"]
        if len(found) != 1:
            raise ValueError(f"cannot tell the expert's activation from its modules (found {found}); pass "
                             f"activation= one of relu, gelu, silu to moe_plugin.integrations.deepspeed.MoE")
        activation = found[0]
    return (first_name, second_name), first.out_features, activation, first.bias is not None


def _ensure_distributed() -> None:
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def _expert_parallel_group(ep_size: int):
    """DeepSpeed's expert-parallel group "ep_size_<ep_size>" of this rank (created, with its expert-data
    groups, when absent: every rank must build the layers in the same order)."""
    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        _ensure_distributed()
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_group(name)


class DeepSpeedMoELayer(MoELayer):
    """An MoELayer standing where DeepSpeed's MOELayer stands (`MoE.deepspeed_moe`).

    forward(x, used_token) -> y, and keeps .l_aux (DeepSpeed's unweighted balance loss) and .exp_counts
    (choices per expert before dropping) as MOELayer does. Its state dict uses the native names.
    """

    def __init__(self, config: MoEConfig, ep_group, linear_names: Tuple[str, str], group_name: str):
        super().__init__(config, ep_group=ep_group)
        self.linear_names = linear_names
        for param in self.experts.parameters():
            param.allreduce = False
            param.group_name = group_name
        self.l_aux = torch.zeros(())
        self.exp_counts = torch.zeros(config.num_experts, dtype=torch.long)
        self.router.register_forward_hook(self._keep_balance_loss)
        self.register_state_dict_post_hook(_to_native_names)
        self.register_load_state_dict_pre_hook(_from_native_names)

    def _keep_balance_loss(self, router, inputs, routes):
        self.l_aux = routes.aux_loss

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        if used_token is not None and self.config.top_k == 1:   # native top-2 ignores used_token too
            raise ValueError("used_token is not supported by backend tutel (DeepSpeed's top-1 gate masks tokens "
                             "with it); pass used_token=None")
        y = super().forward(x)
        self.exp_counts = self._routing[0].to(torch.long)   # on the device: no host synchronization
        return y


def _native_expert_names(layer: DeepSpeedMoELayer) -> Dict[str, str]:
    """Stacked expert tensor -> its name inside one native expert (Linear weights are [out, in])."""
    first, second = layer.linear_names
    return {"w1_EDH": f"{first}.weight", "b1_EH": f"{first}.bias", "w2_EHD": f"{second}.weight",
            "b2_ED": f"{second}.bias"}


def _to_native_names(layer: DeepSpeedMoELayer, state: Dict[str, Any], prefix: str, local_metadata) -> None:
    """router.weight_ED -> gate.wg.weight; stacked experts -> experts.deepspeed_experts.<i>.<linear>.*

    The balancing bias stays only when it is on (the native layer has none, and a missing one loads as
    zeros), as router.Expert_bias_E (see hide_from_expert_files)."""
    state[prefix + "gate.wg.weight"] = state.pop(prefix + "router.weight_ED")
    if layer.config.expert_bias_update_rate == 0:
        state.pop(prefix + "router.expert_bias_E", None)
    hide_from_expert_files(state, prefix, "experts.")
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
    native = _native_expert_names(layer)
    for name in EXPERT_NAMES:
        keys = [f"{prefix}experts.deepspeed_experts.{i}.{native[name]}"
                for i in range(layer.groups.layout.local_experts)]
        if all(key in state for key in keys):
            tensors = [state.pop(key) for key in keys]
            state[f"{prefix}experts.{name}"] = torch.stack([t.t() if t.dim() == 2 else t for t in tensors])


class MoE(NativeMoE):
    """deepspeed.moe.layer.MoE running moe_plugin's router, dispatch, experts and all-to-all.

    Takes deepspeed.moe.layer.MoE's arguments (the expert: Linear(D, H) -> activation -> Linear(H, D))
    plus this project's extras (keyword only). forward(x, used_token=None) -> (output, l_aux, exp_counts)
    like the native layer; aux_loss_coef weights only .deepspeed_moe.aux_loss (moe_plugin.aux_loss(model)),
    never the returned l_aux. ep_size > 1 needs torch.distributed (or deepspeed.init_distributed()) first.

    Not expressible here (see README): noisy_gate_policy, enable_expert_tensor_parallelism (both raise),
    use_rts=True (over-capacity tokens are dropped by position instead of at random) and
    top2_2nd_expert_sampling=True (the second expert is the plain second best); both warn.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, activation: Optional[str] = None,
                 router: str = "softmax", aux_loss_coef: float = 0.01, parallel=1, overlap_degree=1,
                 a2a: str = "flat", node_size: Optional[int] = None, expert_bias_update_rate: float = 0.0,
                 num_groups: int = 1, topk_groups: int = 1, route_scale: float = 1.0,
                 aux_loss: Optional[str] = None) -> None:
        # nn.Module's init, not the native one: that one deep-copies `expert` per local expert
        nn.Module.__init__(self)
        if noisy_gate_policy not in (None, "None"):
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r} is not supported by backend tutel; allowed: None")
        if enable_expert_tensor_parallelism:
            raise ValueError("enable_expert_tensor_parallelism=True is not supported by backend tutel; allowed: False")
        if not _is_int(num_experts, 1) or not _is_int(ep_size, 1) or num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be a multiple of ep_size={ep_size} (both integers >= 1)")
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
                             aux_loss=aux_loss)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size

        linear_names, expert_hidden, activation, bias = _expert_structure(expert, hidden_size, activation)
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
                            route_scale, aux_loss)
        ep_group = _expert_parallel_group(ep_size) if ep_size > 1 else None
        self.deepspeed_moe = DeepSpeedMoELayer(config, ep_group, linear_names, self.expert_group_name)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by the engine: makes sure DeepSpeed's expert and expert-data groups exist."""
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_=True is not supported by backend tutel; allowed: False")
        if groups.mpu is not None and bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
            raise ValueError("backend tutel does not support tensor model parallelism (an mpu with tensor parallel "
                             "size > 1); use backend deepspeed")
        _expert_parallel_group(self.ep_size)


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
    from moe_plugin.integrations.deepspeed_hf import DeepSpeedHFMoEBlock, check_swapped_block
    replaced: Dict[int, List[nn.Parameter]] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, NativeMoE):
            continue
        if isinstance(module, DeepSpeedHFMoEBlock):   # a Hugging Face block swapped before initialize
            check_swapped_block(name, module, section)
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
        settings = {**_native_settings(module), **overrides}
        new = _rebuild(module, settings)
        replaced.update(_parameter_map(module, new))
        if name:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        else:
            model = new
    return model, replaced


def section_key(argument: str) -> str:
    return {v: k for k, v in SECTION_TO_ARGUMENT.items()}.get(argument, argument)


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


def _remap(params, replaced: Dict[int, List[nn.Parameter]]) -> list:
    """Parameters (or param-group dicts) with the swapped layers' parameters replaced, each kept once."""
    out, seen = [], set()
    for item in params:
        if isinstance(item, Mapping):
            out.append({**item, "params": _remap(item["params"], replaced)})
            continue
        for param in replaced.get(id(item), [item]):
            if id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    return out


def _config_dict(args, config, config_params) -> Dict[str, Any]:
    """The DeepSpeed config deepspeed.initialize will read, as a dict."""
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("DeepSpeed needs a config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    return load_ds_config(config)


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu: Any = None, dist_init_required: Optional[bool] = None, collate_fn=None,
               config=None, mesh_param: Any = None, config_params=None):
    """deepspeed.initialize, after applying the config's "moe" section to model (see swap_moe_layers).

    Optimizer parameters come from model_parameters (parameters or param groups; default: every
    parameter that requires grad) with the swapped layers' parameters replaced, split into DeepSpeed's
    MoE groups. A client optimizer must then be a callable (params -> Optimizer), or an Optimizer with
    no state yet, whose groups are remapped in place. Returns deepspeed.initialize's tuple.
    """
    if model is None:
        raise ValueError("initialize needs a model")
    ds_config = _config_dict(args, config, config_params)
    section = read_moe_section(ds_config)
    autoep = ds_config.get("expert_parallel")
    if section is not None and isinstance(autoep, Mapping) and autoep.get("enabled", False):
        raise ValueError("the DeepSpeed config has a \"moe\" section (moe_plugin) and an enabled \"expert_parallel\" "
                         "section (DeepSpeed's AutoEP): both replace the model's MoE blocks; keep one (remove "
                         "\"expert_parallel\" or set its \"enabled\": false; its autoep_size is \"moe.ep_size\" here)")
    has_moe = any(isinstance(m, NativeMoE) for m in model.modules())
    swap_hf = section is not None and not has_moe
    if swap_hf:   # no DeepSpeed MoE layer: a Hugging Face MoE model, or an error naming what was looked for
        from moe_plugin.integrations.deepspeed_hf import check_section_for_model, swap_for_section
        check_section_for_model(model, section)
        has_moe = True
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if has_moe and stage == 3:
        raise ValueError("zero_optimization.stage=3 is not supported with MoE layers (DeepSpeed's native MoE and "
                         "backend tutel alike: expert parameters are not partitioned by ZeRO-3); allowed: "
                         "zero_optimization.stage 0, 1 or 2")
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=distributed_port, dist_init_required=dist_init_required)
    replaced: Dict[int, List[nn.Parameter]] = {}
    if swap_hf:
        model, replaced = swap_for_section(model, section)
    elif section is not None:
        model, replaced = swap_moe_layers(model, section)
    if has_moe:
        if model_parameters is None:
            model_parameters = [p for p in model.parameters() if p.requires_grad]
        model_parameters = configure_moe_param_groups(_remap(list(model_parameters), replaced))
        if isinstance(optimizer, torch.optim.Optimizer) and replaced:
            if optimizer.state:
                raise ValueError("the optimizer passed to initialize already has state for the native MoE layers' "
                                 "parameters, which initialize replaces; pass a callable (params -> Optimizer) or "
                                 "an optimizer that has not stepped yet")
            for group in optimizer.param_groups:
                group["params"] = _remap(group["params"], replaced)
    engine, *rest = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                         model_parameters=model_parameters, training_data=training_data,
                                         lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                                         dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                         mesh_param=mesh_param, config_params=config_params)
    update_bias_every_step(engine)
    return (engine, *rest)


def update_bias_every_step(engine) -> None:
    """When a layer has the balancing bias on, engine.step() calls moe_plugin.update_expert_bias once per
    optimizer step (at the gradient accumulation boundary: the counts cover every micro-batch)."""
    if not any(getattr(m, "config", None) is not None and isinstance(m, MoELayer)
               and m.config.expert_bias_update_rate > 0 for m in engine.module.modules()):
        return
    step = engine.step

    def step_and_update_bias(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()
        result = step(*args, **kwargs)
        if boundary:
            update_expert_bias(engine.module)
        return result
    engine.step = step_and_update_bias
