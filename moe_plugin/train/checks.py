"""load_config and check_config: a run's config read and checked whole, before anything is built. config.py
checks each section on its own; this file adds the MoE layers of the model the run builds (an hf section's
read through transformers: hf_model.py, hf_image.py), their sizes against parallel.ep_size."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..config import MoEConfig
from ..parallel.groups import check_sizes, divisors, holds
from .config import ExperimentConfig, check_sections, moe_config, parse_config
from .hf_image import IMAGE_MODEL_TYPES, image_moe_configs
from .hf_model import hf_moe_configs


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                world: Optional[Tuple[int, str]] = None) -> ExperimentConfig:
    """The defaults, then the YAML file, then the key=value overrides; ValueError on any bad key or value.
    world: (the number of processes, how the user sets it) where it is known before they start (`moe-plugin train
    --nproc-per-node`, `moe-plugin plan --world-size`): parallel.ep_size is checked against it first (check_world),
    so that the values an error suggests are the ones that world accepts."""
    cfg = parse_config(path, overrides)
    if world is not None:
        check_sections(cfg)
        check_world(cfg, *world)
    check_config(cfg)
    return cfg


def check_config(cfg: ExperimentConfig) -> None:
    check_sections(cfg)
    for moe in layer_configs(cfg):
        try:
            check_sizes(moe.num_experts, moe.hidden_size, moe.ep_size)
        except ValueError as error:
            raise ValueError(f"parallel.ep_size={cfg.parallel.ep_size} is invalid: {error}") from None


def _refusing(layers: List[MoEConfig], ep_size: int) -> Optional[MoEConfig]:
    """The first of the layers that cannot be spread over ep_size processes, or None."""
    return next((moe for moe in layers if not holds(moe.num_experts, moe.hidden_size, ep_size)), None)


def check_world(cfg: ExperimentConfig, world_size: int, processes_from: str) -> None:
    """ValueError unless parallel.ep_size suits a run of world_size processes: it divides world_size and every MoE
    layer takes it. processes_from: how the user sets the number of processes N. Every value the message suggests
    is then accepted."""
    ep_size = cfg.parallel.ep_size
    layers = layer_configs(cfg)
    refusing = _refusing(layers, ep_size)
    if world_size % ep_size == 0 and refusing is None:
        return
    working = [w for w in divisors(world_size) if _refusing(layers, w) is None]
    if refusing is not None:
        raise ValueError(f"parallel.ep_size={ep_size} cannot hold num_experts={refusing.num_experts} with "
                         f"hidden_size={refusing.hidden_size}: it must divide num_experts, or be a multiple of it "
                         f"that divides each expert's hidden_size into equal slices; at {world_size} processes "
                         f"set it to one of {working}")
    raise ValueError(f"parallel.ep_size={ep_size} is invalid: must divide the number of processes, {world_size} "
                     f"({processes_from}, N a multiple of {ep_size}; or set parallel.ep_size to one of {working})")


def layer_configs(cfg: ExperimentConfig) -> List[MoEConfig]:
    """The MoEConfig of each MoE layer of the run's model (an hf section's built through transformers)."""
    if cfg.data.task == "image":
        return image_moe_configs(cfg)
    if cfg.hf is not None and cfg.hf.get("model_type") in IMAGE_MODEL_TYPES:
        raise ValueError(f"hf.model_type={cfg.hf['model_type']!r} is an image classifier: it needs data.task='image' "
                         f"(see configs/experiments/swinv2_moe.yaml)")
    if cfg.hf is not None:
        return hf_moe_configs(cfg)
    if cfg.upcycle is not None:
        raise ValueError("upcycle is invalid without an hf section: it turns the dense MLPs of a Hugging Face "
                         "model (hf.model_type: llama, qwen2, mistral, swinv2, ...) into MoE blocks (leave it out)")
    return [moe_config(cfg)]
