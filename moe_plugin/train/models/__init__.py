"""Models for `moe-plugin train`."""
from .transformer import ModelConfig, TransformerLM

__all__ = ["ModelConfig", "TransformerLM"]
