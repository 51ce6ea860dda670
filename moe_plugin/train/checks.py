"""load_config and check_config: a run's config read and checked whole, before anything is built. config.py
checks each section on its own; this file adds the MoE layers of the model the run builds (an hf section's
read through transformers: hf_model.py, hf_image.py), their sizes against parallel.ep_size."""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..config import MoEConfig
from ..parallel.groups import check_sizes
from .config import ExperimentConfig, check_sections, moe_config, parse_config
from .hf_image import IMAGE_MODEL_TYPES, image_moe_configs
from .hf_model import hf_moe_configs


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """The defaults, then the YAML file, then the key=value overrides; ValueError on any bad key or value."""
    cfg = parse_config(path, overrides)
    check_config(cfg)
    return cfg


def check_config(cfg: ExperimentConfig) -> None:
    check_sections(cfg)
    for moe in layer_configs(cfg):
        try:
            check_sizes(moe.num_experts, moe.hidden_size, moe.ep_size)
        except ValueError as error:
            raise ValueError(f"parallel.ep_size={cfg.parallel.ep_size} is invalid: {error}") from None


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
