"""moe_plugin: a fast Mixture-of-Experts layer for PyTorch."""
from .config import MoEConfig
from .layer import MoELayer, aux_loss
from .balancing import update_expert_bias

__version__ = "0.1.0"
__all__ = ["MoEConfig", "MoELayer", "aux_loss", "update_expert_bias", "__version__"]
