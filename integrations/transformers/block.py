"""The module that replaces an HF sparse-MoE block: the family's forward signature on an MoELayer.

Legend: B batch, L sequence length, T tokens (B*L), D model dim, E experts.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from moe_plugin import MoELayer

from .peft import HFExpertsHandle, add_router_handle, peft_adapters_in


class RouterLogits(nn.Module):
    """Hands the router logits to HF's output recorder, which hooks the family's router class.

    transformers 5 records `router_logits` with a forward hook on every instance of the class its
    model names in `_can_record_outputs` (OutputRecorder(<Family>TopKRouter, index=0)), taking
    output[index]. The block makes this module an instance of that class (see router_logits_class),
    so output_router_logits=True and the HF aux loss see our logits. It holds no tensors of its own;
    `weight` and `e_score_correction_bias` are the router's (HF's _init_weights finds them there).
    """

    index = 0

    def __init__(self):
        nn.Module.__init__(self)   # not the HF router's __init__: no weights of its own
        self.__dict__["_router"] = None   # the MoELayer's router, unregistered (set by the block)

    @property
    def weight(self):
        return self._router.weight_ED

    @property
    def e_score_correction_bias(self):
        return self._router.expert_bias_E

    @property
    def bias(self):   # gpt-oss's and Llama 4's routers have one (HF's _init_weights reads it); None without
        return getattr(self._router, "bias_E", None)

    def extra_repr(self) -> str:   # not the HF router's (Llama 4's is an nn.Linear's, reading its sizes)
        return ""

    def __reduce_ex__(self, protocol):
        if len(type(self).__bases__) < 2:   # not made by _tap_class
            return super().__reduce_ex__(protocol)
        base, target = type(self).__bases__
        return _new_tap, (target, self.index, base), self.__dict__

    def forward(self, logits_TE: torch.Tensor):
        out = [None] * (self.index + 1)
        out[self.index] = logits_TE
        return tuple(out)


class RouterInputTap(RouterLogits):
    """Stands in for the router of a decoder layer that calls its router and experts itself (Gemma 4:
    `_, weights, index = router(x)`, then `experts(h, index, weights)`, h a normed copy of x): returns (the fp32
    softmax probabilities, which HF records from Gemma 4's router, when recorded, else None; None; x), so that
    the HFMoEBlock in the experts' place receives the router input x where HF's experts receive the index, and
    the layer routes x itself (MoELayer.forward's router_input)."""

    @property
    def scale(self):   # Gemma 4's router input scale and per-expert gate scale (HF's _init_weights sets them to 1)
        return self._router.input_scale_D

    @property
    def per_expert_scale(self):
        return self._router.gate_scale_E

    def forward(self, x_TD: torch.Tensor):
        probs_TE = None
        if self._forward_hooks and _recording_router_logits():
            probs_TE = torch.softmax(self._router.logits(x_TD), dim=-1, dtype=torch.float32)
        return probs_TE, None, x_TD


def hf_key(name: str, block: "HFMoEBlock", key: str) -> str:
    """The model-wide HF name of the tensor key (relative to the HF block) of the block at name: HF names the
    tensors from the block's place, or (Gemma 4, hf_names_in_parent) from the decoder layer holding it."""
    prefix = name.rpartition(".")[0] if block.hf_names_in_parent else name
    return f"{prefix}.{key}" if prefix else key


def router_logits_name(model_class: type) -> str:
    """The attribute name the tap must have in the block: HF's recorder may match the router by the last part
    of its path too (OutputRecorder(..., layer_name="mlp.gate") for MiniMax and Qwen3-VL-MoE)."""
    spec = (getattr(model_class, "_can_record_outputs", None) or {}).get("router_logits")
    layer_name = getattr(spec, "layer_name", None)
    return layer_name.strip(".").rpartition(".")[2] if layer_name else "router_logits"


def router_logits_class(model_class: type, base: type = RouterLogits) -> Optional[type]:
    """A subclass of base (RouterLogits or RouterInputTap) that is also the class HF records router logits from,
    or None."""
    spec = getattr(model_class, "_can_record_outputs", None) or {}
    spec = spec.get("router_logits")
    if spec is None:
        return None
    target, index = (spec, 1) if isinstance(spec, type) else (spec.target_class, spec.index)
    return _tap_class(target, index, base)


@functools.lru_cache(maxsize=None)
def _tap_class(target: type, index: int, base: type = RouterLogits) -> type:
    """One class per HF router class (made at run time, so pickle finds it through _new_tap)."""
    return type(f"MoEPlugin{target.__name__}", (base, target), {"index": index})


def _new_tap(target: type, index: int, base: type = RouterLogits) -> RouterLogits:
    """An empty instance of _tap_class(target, index, base), for unpickling (its state follows)."""
    cls = _tap_class(target, index, base)
    return cls.__new__(cls)


class HFMoEBlock(nn.Module):
    """forward(hidden_states [B, L, D]) -> [B, L, D], as the HF block it replaces.

    .moe is the MoELayer; .router_logits (when the model records them) exposes its logits to HF (under the name
    tap_name, which HF's recorder may match; see use_tap_name).
    """

    tap_name = "router_logits"
    returns_tuple = False   # (output, None), as gpt-oss's and Llama 4's blocks return (output, router scores)
    hf_names_in_parent = False   # its HF tensors are named from the module above it (Gemma 4's decoder layer)

    def __init__(self, moe: MoELayer, family: str, router_logits: Optional[RouterLogits] = None,
                 jitter_noise: float = 0.0):
        super().__init__()
        self.moe = moe
        self.family = family
        self.router_logits = router_logits
        if moe.experts.stacked:   # HF's names for PEFT's target_parameters (peft.py)
            self.experts = HFExpertsHandle(moe.experts, family)
        add_router_handle(self, moe.router, family)     # HF's name of the router weight, for PEFT (peft.py)
        if router_logits is not None:
            router_logits.__dict__["_router"] = moe.router
        self.jitter_noise = jitter_noise

    def use_tap_name(self, name: str) -> None:
        if name != self.tap_name and self.tap_name in self._modules:
            self._modules[name] = self._modules.pop(self.tap_name)
        self.tap_name = name

    @property
    def tap(self) -> Optional[RouterLogits]:
        return self._modules.get(self.tap_name)

    def reset_parameters(self) -> None:
        """Draws the layer's tensors afresh (after building on the meta device and to_empty): swap_moe_blocks
        sets the HF config's initializer_range as the weights' std, as HF's _init_weights draws its own
        blocks; the expert bias 0. HF's init_weights() calls this through the model's _init_weights."""
        self.moe.reset_parameters()

    def forward(self, hidden_states: torch.Tensor, router_input: Optional[torch.Tensor] = None,
                unused_weights: Optional[torch.Tensor] = None, input_ids: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """router_input, unused_weights: Gemma 4's decoder calls its experts as experts(h, index, weights), and its
        swapped router (a RouterInputTap) hands over the router input in the index's place: the layer routes it.
        input_ids: what DeepSeek-V4's decoder passes (for its hash-routed blocks, which are not swapped); unused."""
        if self.training and self.jitter_noise > 0:   # Mixtral's router_jitter_noise, as HF applies it
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        tap = self.tap
        with peft_adapters_in(self) as router_weight:
            if tap is not None and tap._forward_hooks and _recording_router_logits():
                with router_weight():
                    tap(self.moe.router.logits(hidden_states.reshape(-1, hidden_states.shape[-1])))
            output = self.moe(hidden_states, router_input=router_input)
        return (output, None) if self.returns_tuple else output

    def extra_repr(self) -> str:
        return f"family={self.family!r}"


def _recording_router_logits() -> bool:
    """Whether the HF forward running now collects router logits (skip the logits otherwise)."""
    from transformers.utils.output_capturing import _active_collector
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


def init_blocks_in_init_weights(model: nn.Module) -> None:
    """HF's init_weights() reaches each module through the _init_weights(module) of the PreTrainedModel
    above it, which knows only HF's classes (the router tap gets HF's router init, nothing else of ours):
    each PreTrainedModel's _init_weights also resets the swapped blocks."""
    from transformers import PreTrainedModel
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and "_init_weights" not in vars(module):
            module._init_weights = functools.partial(_init_weights_and_blocks, module)   # picklable


def _init_weights_and_blocks(model: nn.Module, module: nn.Module) -> None:
    type(model)._init_weights(model, module)
    if isinstance(module, HFMoEBlock):
        module.reset_parameters()


def block_type() -> type:
    """The class swap_moe_blocks and upcycle build by default: HFMoEBlock, whatever is installed. DeepSpeed's paths
    (its initialize, the hook, ZeRO-3) turn blocks into their DeepSpeed subclass themselves
    (integrations/deepspeed/hf.py), so this adapter never imports DeepSpeed."""
    return HFMoEBlock
