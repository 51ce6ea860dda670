"""HF Trainer callbacks for swapped models."""
from __future__ import annotations

from transformers import TrainerCallback

from moe_plugin import begin_step, update_expert_bias


class ExpertBiasUpdate(TrainerCallback):
    """Tells the swapped blocks where HF Trainer's optimizer steps begin and end, which Trainer does not itself:
    after every optimizer step, moe_plugin.update_expert_bias(model) moves each block's expert bias (layers with
    expert_bias_update_rate > 0, aux-loss-free balancing) by the choices of every micro-batch of the step, summed
    over processes; before each, moe_plugin.begin_step(model) lets a balance loss counted globally
    (aux_loss_scope="global") count over the step's micro-batches:

        Trainer(model=swap_moe_blocks(model, expert_bias_update_rate=1e-3), ..., callbacks=[ExpertBiasUpdate()])
    """

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        begin_step(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        update_expert_bias(model)
