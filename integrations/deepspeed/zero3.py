"""ZeRO stage 3 and MoE layers: which stage-3 configs the MoE layers can run under."""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["check_zero_stage"]


def check_zero_stage(ds_config: Mapping[str, Any]) -> None:
    """Refuse a config the model's MoE layers cannot train under (called only when the model has MoE layers)."""
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        raise ValueError("zero_optimization.stage=3 is not supported with MoE layers (DeepSpeed's native MoE and "
                         "backend tutel alike: expert parameters are not partitioned by ZeRO-3); allowed: "
                         "zero_optimization.stage 0, 1 or 2")
