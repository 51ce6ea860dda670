"""HF Trainer callbacks for swapped models."""
from __future__ import annotations

from transformers import TrainerCallback

from moe_plugin import update_expert_bias


class ExpertBiasUpdate(TrainerCallback):
    """Aux-loss-free balancing under HF Trainer: after every optimizer step, moe_plugin.update_expert_bias(model)
    moves each block's expert bias (layers with expert_bias_update_rate > 0) by the choices of every
    micro-batch of the step, summed over processes. Trainer runs no such update itself:

        Trainer(model=swap_moe_blocks(model, expert_bias_update_rate=1e-3), ..., callbacks=[ExpertBiasUpdate()])
    """

    def on_step_end(self, args, state, control, model=None, **kwargs):
        update_expert_bias(model)
