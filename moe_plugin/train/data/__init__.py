"""The data tasks of `moe-plugin train`: data.task lm (text.py: bytes as tokens) and image (images.py: the
digits); config.py holds the data section, batches.py the Data every task gives."""
from .batches import Batch, Data
from .config import IMAGE_KEYS, TASKS, DataConfig, check_config
from .images import make_image_data
from .text import PATTERN_SYMBOLS, TOPICS, VOCAB_SIZE, decode, make_text_data


def make_data(cfg: DataConfig, batch_size: int, seq_len: int, val_batches: int,
              rank: int = 0, world_size: int = 1) -> Data:
    """The task's data; seq_len applies to data.task='lm' only."""
    if cfg.task == "image":
        return make_image_data(cfg, batch_size, val_batches, rank, world_size)
    return make_text_data(cfg, batch_size, seq_len, val_batches, rank, world_size)


__all__ = ["Batch", "Data", "IMAGE_KEYS", "TASKS", "DataConfig", "check_config", "PATTERN_SYMBOLS", "TOPICS",
           "VOCAB_SIZE", "decode", "make_data", "make_image_data", "make_text_data"]
