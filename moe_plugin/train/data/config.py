"""The data section of an experiment config: DataConfig and its checks."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .images import DATASETS

TASKS = ("lm", "image")
IMAGE_KEYS = {"dataset": "digits", "image_size": 32, "augment": True}   # data.task=image only; defaults


@dataclass
class DataConfig:
    task: str = "lm"             # lm: bytes as tokens (a language model); image: image classification
    path: Optional[str] = None   # a text file (its bytes are the tokens); null: the synthetic corpus
    seed: int = 0                # the synthetic corpus: its languages and every stream; images: split, order
    val_fraction: float = 0.05   # a text file: the share at its end held out; images: of each class
    dataset: str = IMAGE_KEYS["dataset"]        # images: digits (scikit-learn's 8x8 handwritten digits)
    image_size: int = IMAGE_KEYS["image_size"]  # images: upsampled to image_size x image_size
    augment: bool = IMAGE_KEYS["augment"]       # images: random rotation, scale and shift of training images


def check_config(cfg: DataConfig) -> None:
    if cfg.task not in TASKS:
        raise ValueError(f"data.task={cfg.task!r} is invalid: must be one of {', '.join(map(repr, TASKS))}")
    if cfg.path is not None and not os.path.isfile(cfg.path):
        raise ValueError(f"data.path={cfg.path!r} is invalid: no such file")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={cfg.val_fraction!r} is invalid: must be between 0 and 1")
    if cfg.task == "lm":
        for key, default in IMAGE_KEYS.items():
            if getattr(cfg, key) != default:
                raise ValueError(f"data.{key}={getattr(cfg, key)!r} is invalid with data.task='lm': it applies "
                                 f"to data.task='image' only (leave it out)")
        return
    if cfg.path is not None:
        raise ValueError(f"data.path={cfg.path!r} is invalid with data.task='image': the images come from "
                         f"data.dataset (leave data.path null)")
    if cfg.dataset not in DATASETS:
        raise ValueError(f"data.dataset={cfg.dataset!r} is invalid: must be one of {', '.join(map(repr, DATASETS))}")
    if cfg.image_size < 8:
        raise ValueError(f"data.image_size={cfg.image_size!r} is invalid: must be >= 8")
