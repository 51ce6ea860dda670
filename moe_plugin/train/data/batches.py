"""What every data task gives the trainer: Data (the training stream, the validation batches, rows per topic)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

Batch = Tuple[torch.Tensor, torch.Tensor]   # (inputs, targets)


@dataclass
class Data:
    train: object                  # .next() -> Batch, .state_dict(), .load_state_dict()
    val: List[Batch]               # the same fixed batches on every rank
    topics: Dict[str, torch.Tensor]  # x_BS per topic of the synthetic corpus (empty for a text file); images per class
