"""upcycle: the dense MLPs of a Hugging Face model become MoE blocks whose experts start as copies of them
(Komatsuzaki et al., "Sparse Upcycling", arXiv 2212.05055).

The MLPs it recognises (in model.named_modules() order; that order numbers them, see mlp_sites):
  gated  a module with Linear gate_proj, up_proj, down_proj and an act_fn (llama, qwen2, mistral, gemma, ...):
         down(act(gate x) * up x), our swiglu / geglu / geglu_tanh experts (w1 columns [gate | up]) for a
         silu / gelu / tanh-approximated gelu act_fn;
  plain  a module with Linear fc1, fc2 and an activation_fn (ViT, CLIP, ...): fc2(act(fc1 x));
  pair   a layer holding `intermediate` (Linear dense + intermediate_act_fn) and `output` (Linear dense,
         then dropout, ...) (Swin, Swinv2, BERT-style): `intermediate` becomes the MoE block and
         `output.dense` an nn.Identity, so the output's dropout (and residual/LayerNorm, where it has them)
         applies to the MoE's output as it applied to the dense MLP's.
The activation is recognised by its values (relu, gelu (exact erf), gelu_tanh, silu; the layer's plain experts
take relu, gelu and silu, its gated ones silu and both gelus); others are an error.

Legend: D model dim, H dense (and expert) hidden dim, E experts.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.experts import WEIGHT_NAMES, short_name

from .block import block_type, init_blocks_in_init_weights

ACTIVATIONS = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
               "silu": F.silu}
PLAIN = ("relu", "gelu", "silu")                                         # the layer's plain expert activations
GATED = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}   # act(gate) * up: the layer's name
FIXED_BY_MLP = ("model_dim", "hidden_size", "activation", "bias")
DROPLESS = 0.0   # upcycle's default capacity_factor: no token dropped, so step 0 is the dense model
ATTRIBUTE = "moe_plugin_upcycled"   # the model attribute recording what upcycle did (export reads it)


def mlp_sites(model: nn.Module) -> List[Tuple[str, str]]:
    """(module name, kind) of every dense MLP upcycle recognises, in model.named_modules() order: the index
    in this list is the layer number `layers=` and `every=` refer to. Decoder LMs: model.layers[i] is i.
    Swin/Swinv2: the blocks of stage 0, then of stage 1, ...: block b of stage s is sum(depths[:s]) + b."""
    sites, inside = [], None
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        kind = _kind(name, module)
        if kind is not None:
            sites.append((name, kind))
            inside = f"{name}." if name else ""
    return sites


def _kind(name: str, module: nn.Module) -> Optional[str]:
    linear = functools.partial(_is_linear, module)
    if linear("gate_proj", "up_proj", "down_proj") and hasattr(module, "act_fn") and "shared" not in name:
        return "gated"
    if linear("fc1", "fc2") and hasattr(module, "activation_fn"):
        return "plain"
    inter, out = getattr(module, "intermediate", None), getattr(module, "output", None)
    if isinstance(inter, nn.Module) and isinstance(out, nn.Module) and _is_linear(inter, "dense") \
            and _is_linear(out, "dense") and hasattr(inter, "intermediate_act_fn"):
        return "pair"
    return None


def _is_linear(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def dense_parts(site: nn.Module, kind: str) -> Tuple[nn.Linear, Optional[nn.Linear], nn.Linear, Any]:
    """(first Linear, the up Linear of a gated MLP or None, last Linear, activation) of a site."""
    if kind == "gated":
        return site.gate_proj, site.up_proj, site.down_proj, site.act_fn
    if kind == "plain":
        return site.fc1, None, site.fc2, site.activation_fn
    return site.intermediate.dense, None, site.output.dense, site.intermediate.intermediate_act_fn


def activation_of(act, where: str) -> str:
    """The name of our activation computing what act computes (compared on values), or ValueError."""
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act(x)
    except Exception:   # noqa: BLE001 (any failure: not a recognisable elementwise activation)
        y = None
    for name, fn in ACTIVATIONS.items():
        if torch.is_tensor(y) and y.shape == x.shape and torch.allclose(y, fn(x), atol=1e-7, rtol=0):
            return name
    raise ValueError(f"upcycle: the activation of {where} ({type(act).__name__}) computes none of "
                     f"{', '.join(ACTIVATIONS)} (the MoE layer's experts support those)")


def dense_state(site: nn.Module, kind: str, where: str) -> Tuple[Dict[str, torch.Tensor], str]:
    """One expert's tensors in the layer's layout (w1_DH [D, H or 2H], b1_H, w2_HD [H, D], b2_D) from the
    dense MLP, and the experts' activation."""
    first, up, last, act = dense_parts(site, kind)
    activation = activation_of(act, where)
    if kind == "gated":
        if activation not in GATED:
            raise ValueError(f"upcycle: {where} is a gated MLP with a {activation} activation; the MoE layer's "
                             f"gated experts take {', '.join(GATED)}")
        activation = GATED[activation]
    elif activation not in PLAIN:
        raise ValueError(f"upcycle: {where} is an MLP with a {activation} activation; the MoE layer's plain "
                         f"experts take {', '.join(PLAIN)} (gelu_tanh only gated)")
    linears = [first, last] + ([up] if up is not None else [])
    if len({lin.bias is None for lin in linears}) > 1:
        raise ValueError(f"upcycle: the Linears of {where} mix bias and no bias; the MoE layer's experts have "
                         f"biases on both projections or on none")
    w1 = first.weight if up is None else torch.cat([first.weight, up.weight])
    state = {"w1": w1.detach().t(), "w2": last.weight.detach().t()}
    if first.bias is not None:
        b1 = first.bias if up is None else torch.cat([first.bias, up.bias])
        state.update(b1=b1.detach(), b2=last.bias.detach())
    return state, activation


def expert_copies(dense: Dict[str, torch.Tensor], num_experts: int, noise: float, reinit_fraction: float,
                  init_std: float, seed: int, gated: bool) -> Dict[str, torch.Tensor]:
    """The experts stacked [E, ...]: each a copy of the dense tensors; then (expert e from its own generator,
    seeded with seed + e, so any ep_size gives the same experts) noise added to the weights, normal with
    std noise * (the dense tensor's std), and round(reinit_fraction * H) hidden units chosen at random
    drawn afresh: their w1 columns (gate and up for SwiGLU) and w2 rows normal(0, init_std), their b1 0;
    at reinit_fraction 1.0 b2 is 0 too (an expert drawn wholly fresh)."""
    hidden = dense["w2"].shape[0]
    units = round(reinit_fraction * hidden)
    experts = {key: [] for key in dense}
    for e in range(num_experts):
        generator = torch.Generator(device="cpu").manual_seed(seed + e)
        expert = {key: t.detach().to("cpu", torch.float32).clone() for key, t in dense.items()}
        if noise > 0:
            for key in ("w1", "w2"):
                expert[key] += noise * dense[key].float().std().cpu() * torch.randn(
                    expert[key].shape, generator=generator)
        if units:
            chosen = torch.randperm(hidden, generator=generator)[:units]
            columns = torch.cat([chosen, chosen + hidden]) if gated else chosen
            expert["w1"][:, columns] = torch.randn(expert["w1"].shape[0], len(columns), generator=generator) * init_std
            expert["w2"][chosen] = torch.randn(units, expert["w2"].shape[1], generator=generator) * init_std
            if "b1" in expert:
                expert["b1"][columns] = 0.0
                if units == hidden:
                    expert["b2"].zero_()
        for key, tensor in expert.items():
            experts[key].append(tensor.to(dense[key].device, dense[key].dtype))
    return {key: torch.stack(tensors) for key, tensors in experts.items()}


def choose_layers(num_sites: int, every: int, layers: Optional[Iterable[int]]) -> List[int]:
    """The layer numbers upcycled: those in layers (default all) with (i + 1) % every == 0."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"upcycle: every={every!r} is invalid: must be an integer >= 1 (1: every layer; k: layers "
                         f"k-1, 2k-1, ...)")
    if layers is None:
        layers = range(num_sites)
    elif isinstance(layers, (int, str)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"upcycle: layers={layers!r} is invalid: must be None or a list of layer numbers "
                         f"(integers 0..{num_sites - 1})")
    layers = sorted(set(layers))
    outside = [i for i in layers if not 0 <= i < num_sites]
    if outside:
        raise ValueError(f"upcycle: layers={layers!r} has {outside} out of range: the model has {num_sites} dense "
                         f"MLP layers, numbered 0..{num_sites - 1} (see mlp_sites(model))")
    chosen = [i for i in layers if (i + 1) % every == 0]
    if not chosen:
        raise ValueError(f"upcycle: every={every} with layers={layers!r} selects no layer (layer i is chosen when "
                         f"(i + 1) % every == 0)")
    return chosen


def upcycle(model: nn.Module, num_experts: int = 8, top_k: int = 2, every: int = 1,
            layers: Optional[Iterable[int]] = None, *, noise: float = 0.0, reinit_fraction: float = 0.0,
            ep_group=None, block_class: Optional[type] = None, **moe_overrides: Any) -> nn.Module:
    """Replace, in place, the dense MLPs of the chosen layers of an HF model with MoE blocks (HFMoEBlock on an
    MoELayer, as swap_moe_blocks builds them) whose num_experts experts start as copies of that layer's MLP.

    every: upcycle layers k-1, 2k-1, ... (every=1: all; every=2: 1, 3, 5, ..., as Qwen2-MoE's
      decoder_sparse_step and SwinV2-MoE's odd blocks); layers: the layer numbers to consider (mlp_sites
      numbers them; default all); a layer is upcycled when it is in layers and (i + 1) % every == 0.
    noise: each expert's weights get normal noise of std noise * (that dense weight's std).
    reinit_fraction: the share of each expert's hidden units drawn afresh (normal(0, initializer_range));
      1.0 gives independently initialised experts (see expert_copies).
    The router's weight is drawn normal(0, config.initializer_range) (as HF draws its routers); with copies
    of one MLP every expert computes the same, so at step 0 it changes nothing when the top-k gates are
    normalized (normalize_gate, MoEConfig's default for top_k > 1) and no token is dropped.
    Upcycling is dropless by default (capacity_factor=0, as swap_moe_blocks follows HF's dropless routing), so
    the model starts where the dense one is. A capacity (capacity_factor > 0, or < 0 for adaptive) is an
    override: tokens past an expert's capacity are dropped, so from step 0 those tokens' MLP output is 0 and the
    upcycled model no longer computes the dense one.
    moe_overrides: any other MoEConfig field (capacity_factor, aux_loss, router, ep_size, ...); model_dim,
    hidden_size, activation and bias are the dense MLP's. ep_group, block_class: as swap_moe_blocks.
    Under expert parallelism every rank must call it (with the same RNG state); each keeps its share.
    Returns model.
    """
    _check_noise_and_fraction(noise, reinit_fraction)
    planned = plan(model, num_experts, top_k, every, layers, **moe_overrides)
    hf_config = getattr(model, "config", None)
    init_std = float(getattr(hf_config, "initializer_range", 0.02))
    seed = int(torch.randint(0, 2**62, (), device="cpu"))
    block_class = block_class or block_type()
    for index, name, kind, dense, config in planned:
        site = model.get_submodule(name)
        experts = expert_copies(dense, num_experts, noise, reinit_fraction, init_std, seed + index * 1_000_003,
                                config.activation in GATED.values())
        block = _new_block(config, experts, init_std, ep_group, block_class, getattr(hf_config, "model_type", None))
        _install(model, name, kind, site, block.train(site.training))
    init_blocks_in_init_weights(model)
    model.__dict__[ATTRIBUTE] = dict(num_experts=num_experts, top_k=top_k, layers=[p[0] for p in planned],
                                     sites=[(p[1], p[2]) for p in planned], noise=noise,
                                     reinit_fraction=reinit_fraction, moe_overrides=dict(moe_overrides))
    return model


def plan(model: nn.Module, num_experts: int, top_k: int, every: int = 1, layers: Optional[Iterable[int]] = None,
         **moe_overrides: Any) -> List[Tuple[int, str, str, Dict[str, torch.Tensor], MoEConfig]]:
    """What upcycle would do, checked, without changing model: per chosen layer (number, module name, kind,
    the dense MLP's tensors in the layer's layout, the MoEConfig of its block). Works on the meta device."""
    for key in FIXED_BY_MLP + ("num_experts", "top_k"):
        if key in moe_overrides:
            what = "upcycle's own argument" if key in ("num_experts", "top_k") else "the dense MLP"
            raise ValueError(f"upcycle: {key}={moe_overrides[key]!r} cannot be overridden: it is set by {what}")
    for name, value in (("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"upcycle: {name}={value!r} is invalid: must be an integer >= 1")
    if top_k > num_experts:
        raise ValueError(f"upcycle: top_k={top_k} is invalid: must be at most num_experts={num_experts}")
    if getattr(model, ATTRIBUTE, None) is not None:
        raise ValueError("upcycle: the model is upcycled already; upcycle a dense model")
    sites = mlp_sites(model)
    if not sites:
        raise ValueError(f"upcycle: {type(model).__name__} has no dense MLP upcycle recognises: looked for modules "
                         f"with Linear gate_proj/up_proj/down_proj and act_fn (llama, qwen2, mistral), Linear "
                         f"fc1/fc2 and activation_fn (ViT), or intermediate.dense + output.dense (Swin, Swinv2)")
    planned = []
    for index in choose_layers(len(sites), every, layers):
        name, kind = sites[index]
        dense, activation = dense_state(model.get_submodule(name), kind, name or type(model).__name__)
        config = MoEConfig(**{"capacity_factor": DROPLESS, **moe_overrides, "model_dim": dense["w1"].shape[0], "hidden_size": dense["w2"].shape[0],
                              "num_experts": num_experts, "top_k": top_k, "activation": activation,
                              "bias": "b1" in dense})
        planned.append((index, name, kind, dense, config))
    return planned


def _check_noise_and_fraction(noise, reinit_fraction) -> None:
    for name, value, top in (("noise", noise, None), ("reinit_fraction", reinit_fraction, 1.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                or (top is not None and value > top) or value == float("inf"):
            raise ValueError(f"upcycle: {name}={value!r} is invalid: must be a number >= 0"
                             + ("" if top is None else f" and <= {top}"))


def _new_block(config: MoEConfig, experts: Dict[str, torch.Tensor], init_std: float, ep_group, block_class,
               model_type: Optional[str]) -> nn.Module:
    reference = experts["w1"]
    layer = MoELayer(config, ep_group=ep_group)
    for part in (layer.router, layer.experts):
        part.init_std = init_std      # reset_parameters (HF's init_weights) draws as HF draws its blocks
    layer.router.reset_parameters()
    state = {k: v for k, v in layer.state_dict().items() if not k.startswith("experts.")}
    names = {short_name(name): f"experts.{name}" for name in WEIGHT_NAMES}
    state.update({names[key]: tensor for key, tensor in experts.items()})
    layer.to(device=reference.device, dtype=reference.dtype)
    layer.load_full_state_dict(state)
    return block_class(layer, f"{model_type or 'dense'} (upcycled)")


def _install(model: nn.Module, name: str, kind: str, site: nn.Module, block: nn.Module) -> None:
    if kind == "pair":
        site.intermediate = block
        site.output.dense = nn.Identity()
        return
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, block)


def is_upcycled(model: nn.Module) -> bool:
    return getattr(model, ATTRIBUTE, None) is not None


def upcycled_blocks(model: nn.Module) -> List[Tuple[str, str, nn.Module]]:
    """(site name, kind, block) of every upcycled layer."""
    record = getattr(model, ATTRIBUTE)
    out = []
    for name, kind in record["sites"]:
        site = model.get_submodule(name)
        out.append((name, kind, site.intermediate if kind == "pair" else site))
    return out
