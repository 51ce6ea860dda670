"""Image classification data for `moe-plugin train` (data.task: image): scikit-learn's handwritten digits.

The digits (1,797 grayscale 8x8 images of the digits 0-9, about 180 of each; scikit-learn ships them,
so nothing is downloaded) are upsampled once to data.image_size and split by class: data.val_fraction
of each digit's images is held out for validation, chosen by data.seed. Training batches are drawn
epoch by epoch in a shuffled order; with data.augment each training image gets a small random
rotation, scale and shift. Every random draw comes from the batch stream's own generator, so
state_dict() / load_state_dict() resume it exactly. Rank r of P processes reads its own shard.

Legend: N images, B batch, C channels (1), H and W height and width, L labels (10).
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

from .batches import Batch, Data

DATASETS = ("digits",)
NUM_CLASSES = 10
NUM_CHANNELS = 1
SOURCE_SIZE = 8
MAX_ROTATION = math.radians(10)
MAX_SCALE_CHANGE = 0.1
MAX_SHIFT = 1 / SOURCE_SIZE   # of the image's width: one pixel of the 8x8 original


def load_digits() -> Batch:
    """(x_NHW in [0, 1], y_N): the 8x8 digits as scikit-learn ships them."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise ValueError("data.task='image' with data.dataset='digits' needs scikit-learn: "
                         "pip install 'moe_plugin[images]' (or scikit-learn)") from None
    digits = sklearn_digits()
    return torch.tensor(digits.images, dtype=torch.float32) / 16.0, torch.tensor(digits.target, dtype=torch.long)


def split_by_class(y_N: torch.Tensor, val_fraction: float, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, val): round(val_fraction * n) of each class's n images for validation, both shuffled."""
    generator = torch.Generator().manual_seed(seed)
    train, val = [], []
    for label in range(NUM_CLASSES):
        members = (y_N == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        cut = round(val_fraction * len(members))
        val.append(members[:cut])
        train.append(members[cut:])
    train_N, val_N = torch.cat(train), torch.cat(val)
    return (train_N[torch.randperm(len(train_N), generator=generator)],
            val_N[torch.randperm(len(val_N), generator=generator)])


def random_affine(x_BCHW: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Each image rotated, scaled and shifted at random (bilinear; the background, 0, fills in)."""
    B = len(x_BCHW)
    angle_B = (torch.rand(B, generator=generator) * 2 - 1) * MAX_ROTATION
    scale_B = 1 + (torch.rand(B, generator=generator) * 2 - 1) * MAX_SCALE_CHANGE
    shift_B2 = (torch.rand(B, 2, generator=generator) * 2 - 1) * 2 * MAX_SHIFT   # grid coordinates span 2
    cos_B, sin_B = torch.cos(angle_B) * scale_B, torch.sin(angle_B) * scale_B
    theta_B23 = torch.stack([torch.stack([cos_B, -sin_B, shift_B2[:, 0]], 1),
                             torch.stack([sin_B, cos_B, shift_B2[:, 1]], 1)], 1)
    grid = F.affine_grid(theta_B23, list(x_BCHW.shape), align_corners=False)
    return F.grid_sample(x_BCHW, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


class ImageBatches:
    """Batches of one rank's training images, epoch after epoch in a fresh shuffled order (a batch may
    straddle two epochs); augmented, then normalized by the training set's mean and std."""

    def __init__(self, x_NCHW: torch.Tensor, y_N: torch.Tensor, seed: int, batch_size: int, augment: bool,
                 mean: float, std: float):
        self.x_NCHW, self.y_N, self.batch_size, self.augment = x_NCHW, y_N, batch_size, augment
        self.mean, self.std = mean, std
        self.generator = torch.Generator().manual_seed(seed)
        self.order_N = torch.empty(0, dtype=torch.long)   # the rest of the current epoch

    def next(self) -> Batch:
        while len(self.order_N) < self.batch_size:
            self.order_N = torch.cat([self.order_N, torch.randperm(len(self.y_N), generator=self.generator)])
        index_B, self.order_N = self.order_N[:self.batch_size], self.order_N[self.batch_size:]
        x_BCHW = self.x_NCHW[index_B]
        if self.augment:
            x_BCHW = random_affine(x_BCHW, self.generator)
        return (x_BCHW - self.mean) / self.std, self.y_N[index_B]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "order": self.order_N.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.order_N = state["order"].clone()


def make_image_data(cfg, batch_size: int, val_batches: int, rank: int = 0, world_size: int = 1):
    """A Data of images: train stream, validation batches (at most val_batches of batch_size, the same on
    every rank), and per digit a few validation images (for routing per class)."""
    x_NHW, y_N = load_digits()
    x_NCHW = F.interpolate(x_NHW[:, None], size=(cfg.image_size, cfg.image_size), mode="bilinear",
                           align_corners=False).clamp(0, 1)
    train_N, val_N = split_by_class(y_N, cfg.val_fraction, cfg.seed)
    shard_N = train_N.tensor_split(world_size)[rank]
    if len(shard_N) < batch_size:
        raise ValueError(f"train.batch_size={batch_size} is invalid: each of {world_size} process(es) has only "
                         f"{len(shard_N)} training images (data.val_fraction={cfg.val_fraction})")
    mean, std = x_NCHW[train_N].mean().item(), x_NCHW[train_N].std().item()
    train = ImageBatches(x_NCHW[shard_N], y_N[shard_N], cfg.seed * 1_000_003 + rank, batch_size, cfg.augment,
                         mean, std)
    val_x, val_y = (x_NCHW[val_N] - mean) / std, y_N[val_N]
    val: List[Batch] = list(zip(val_x.split(batch_size), val_y.split(batch_size)))[:val_batches]
    classes: Dict[str, torch.Tensor] = {f"digit {label}": val_x[val_y == label][:16] for label in range(NUM_CLASSES)}
    return Data(train, val, classes)
