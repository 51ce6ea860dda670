"""The trainer's models moved to moe_plugin.train.models; this name stays because earlier docs showed
`moe_plugin.models.TransformerLM`."""
from .train.models import ModelConfig, TransformerLM

__all__ = ["ModelConfig", "TransformerLM"]
