"""A Hugging Face image classifier as the model of `moe-plugin train` (data.task: image).

The `hf` section is the transformers config (model_type swinv2 and any of its fields); the model is
transformers' Swinv2ForImageClassification with fresh random weights (no download). num_channels,
num_labels and image_size come from the data and may be left out. Its dense MLPs become MoE blocks on
moe_plugin's layer through moe_plugin.integrations.transformers.upcycle (SwinV2-MoE: every other block
of the later stages, see configs/experiments/swinv2_moe.yaml); without MoE it is the dense model.

Legend: B batch, C channels, H and W height and width, L labels.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import torch
from torch import nn

from ..config import MoEConfig
from ..layer import MoELayer
from .data.images import NUM_CHANNELS, NUM_CLASSES
from .hf_model import hf_adapter, load_dense, upcycle_module
from .hf_model import upcycle_arguments as hf_upcycle_arguments

IMAGE_MODEL_TYPES = ("swinv2",)


def image_hf_config(cfg):
    """The transformers config of the `hf` section for data.task=image; ValueError naming the key on a bad one."""
    if cfg.hf is None:
        raise ValueError("data.task='image' needs an hf section: the image classifier's transformers config "
                         "(model_type: swinv2 and its fields; see configs/experiments/swinv2_moe.yaml)")
    hf_adapter()
    import transformers
    values: Dict[str, Any] = dict(cfg.hf)
    model_type = values.pop("model_type", None)
    if model_type not in IMAGE_MODEL_TYPES:
        raise ValueError(f"hf.model_type={model_type!r} is invalid with data.task='image': must be one of "
                         f"{', '.join(IMAGE_MODEL_TYPES)} (a Hugging Face image classifier)")
    config_class = transformers.CONFIG_MAPPING[model_type]
    valid = {f.name for f in dataclasses.fields(config_class)} | set(config_class.attribute_map) | {"num_labels"}
    for key in values:
        if key not in valid or key.startswith("_"):
            raise ValueError(f"hf.{key} is not a field of {config_class.__name__}; valid keys: "
                             f"{', '.join(sorted(k for k in valid if not k.startswith('_')))}")
    from_data = (("num_channels", NUM_CHANNELS), ("num_labels", NUM_CLASSES), ("image_size", cfg.data.image_size))
    for key, value in from_data:
        if values.setdefault(key, value) != value:
            source = "data.image_size" if key == "image_size" else f"data.dataset={cfg.data.dataset!r}"
            raise ValueError(f"hf.{key}={values[key]!r} is invalid: {source} gives {value} (leave it out)")
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"hf section ({model_type}): {str(error).splitlines()[0]}") from None
    _check_swinv2(config)
    return config


def _check_swinv2(config) -> None:
    depths, heads = list(config.depths), list(config.num_heads)
    if len(depths) != len(heads):
        raise ValueError(f"hf.num_heads={heads} is invalid: must have one entry per stage, as hf.depths={depths}")
    for stage, num_heads in enumerate(heads):
        width = config.embed_dim * 2 ** stage
        if width % num_heads:
            raise ValueError(f"hf.num_heads={heads} is invalid: stage {stage + 1} is {width} wide "
                             f"(hf.embed_dim={config.embed_dim} x 2^{stage}), which {num_heads} heads do not divide")


def stage_widths(config) -> List[int]:
    """Per block, in mlp_sites order (the blocks of stage 0, then of stage 1, ...): its width (its MLP's model_dim)."""
    return [config.embed_dim * 2 ** stage for stage, depth in enumerate(config.depths) for _ in range(depth)]


def upcycle_arguments(cfg) -> Dict[str, Any]:
    """upcycle()'s keyword arguments from the upcycle and moe sections (cfg.upcycle must be set), as for a
    dense language model (hf_model.upcycle_arguments): a moe key the dense MLP fixes is an error."""
    return hf_upcycle_arguments(cfg, mlp_keys="hf.embed_dim, hf.mlp_ratio, hf.hidden_act")


def image_moe_configs(cfg) -> List[MoEConfig]:
    """The MoEConfig of each upcycled block (none for the dense model): what check_config checks, without
    building the model."""
    config = image_hf_config(cfg)
    if cfg.parallel.fsdp:
        raise ValueError("parallel.fsdp=true is invalid with data.task='image': not supported yet (use DDP)")
    if cfg.upcycle is None:
        return []
    upcycle = upcycle_module()
    arguments = upcycle_arguments(cfg)
    moe = {k: v for k, v in arguments.items() if k not in ("every", "layers", "noise", "reinit_fraction")}
    widths = stage_widths(config)
    try:
        chosen = upcycle.choose_layers(len(widths), cfg.upcycle.every, cfg.upcycle.layers)
    except ValueError as error:
        raise ValueError(f"upcycle section: {error}") from None
    configs = []
    for index in chosen:
        try:
            configs.append(MoEConfig.from_dict({**moe, "model_dim": widths[index],
                                                "hidden_size": int(widths[index] * config.mlp_ratio),
                                                "activation": "gelu"}))
        except (ValueError, TypeError) as error:
            raise ValueError(f"moe section: {error}") from None
    return configs


class HFImageClassifier(nn.Module):
    """forward(x_BCHW pixels) -> logits_BL; .hf is the transformers model."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def moe_layers(self) -> List[MoELayer]:
        return [m for m in self.hf.modules() if isinstance(m, MoELayer)]

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self.hf(pixel_values=x_BCHW).logits


def export_image_model(model: HFImageClassifier, directory) -> None:
    """The trained model as a folder: an upcycled model's as export_hf writes it (the dense model's folder, its
    MLPs the mean of their experts, plus moe_plugin's expert files; load_upcycled(folder) in
    moe_plugin.integrations.transformers.upcycle_export rebuilds it), a dense model's by save_pretrained
    (AutoModelForImageClassification.from_pretrained loads it). Under expert parallelism every process must call it."""
    import torch.distributed as dist
    if upcycle_module().is_upcycled(model.hf):
        hf_adapter().export_hf(model.hf, directory)
    elif not dist.is_initialized() or dist.get_rank() == 0:
        model.hf.save_pretrained(directory)


def build_image_model(cfg) -> HFImageClassifier:
    """The image classifier of the `hf` section, random weights from the torch RNG (or, with upcycle.checkpoint,
    the dense run's); with an upcycle section its chosen MLPs become MoE blocks (every process builds all the
    experts; under expert parallelism each keeps its share)."""
    import transformers
    config = image_hf_config(cfg)
    model = transformers.AutoModelForImageClassification.from_config(config)
    if cfg.upcycle is not None:
        if cfg.upcycle.checkpoint is not None:   # sparse upcycling of a trained dense run
            load_dense(model, cfg.upcycle.checkpoint, "AutoModelForImageClassification")
        hf_moe = hf_adapter()
        # plain blocks: the trainer runs its own data and expert parallelism, whatever hosts are installed
        hf_moe.upcycle(model, block_class=hf_moe.HFMoEBlock, **upcycle_arguments(cfg))
    return HFImageClassifier(model)
