"""Hugging Face MoE models on moe_plugin's layer (extra `transformers`; transformers 5.23).

    swap_moe_blocks(model, **overrides) -> model   every sparse-MoE block -> HFMoEBlock on an MoELayer
    export_hf(model, directory)                    an HF folder that AutoModelForCausalLM loads
    upcycle(model, num_experts, top_k, ...)        dense MLPs -> MoE blocks of copies of them (upcycle.py)
    FAMILIES, family_of(model)                     the family table (families.py)
    hf_to_layer / layer_to_hf                      the weight mappings, both ways
    ExpertBiasUpdate()                             HF Trainer callback: marks each optimizer step (bias, global counts)
    RoutingMetrics()                               HF Trainer callback: per-layer routing metrics in its logs
"""
from .torchaudio_guard import hide_unloadable_torchaudio

hide_unloadable_torchaudio()   # before any transformers model module is imported (see the module)

from .block import HFMoEBlock, RouterLogits, block_type  # noqa: E402
from .export import export_hf  # noqa: E402
from .writer import hf_state_dict  # noqa: E402
from . import experts_backend  # noqa: F401,E402  (registers "moe_plugin" in HF's ExpertsInterface)
from .families import (FAMILIES, Family, WeightMap, family_of, hf_config_of, hf_to_layer, layer_to_hf,
                       require_family)  # noqa: E402
from .swap import moe_config, swap_moe_blocks  # noqa: E402
from .upcycle import mlp_sites, upcycle  # noqa: E402

__all__ = ["swap_moe_blocks", "upcycle", "mlp_sites", "export_hf", "hf_state_dict", "moe_config", "HFMoEBlock",
           "RouterLogits", "block_type", "FAMILIES", "Family", "WeightMap", "family_of", "hf_config_of",
           "require_family", "hf_to_layer", "layer_to_hf", "hide_unloadable_torchaudio", "ExpertBiasUpdate",
           "RoutingMetrics"]


def __getattr__(name):
    if name in ("ExpertBiasUpdate", "RoutingMetrics"):
        from . import callbacks, routing_callback   # on first use: transformers' Trainer machinery takes about a second
        return getattr(callbacks if name == "ExpertBiasUpdate" else routing_callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
