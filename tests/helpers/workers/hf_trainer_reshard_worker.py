"""Run under torchrun by test_deepspeed_hf.py: HF Trainer with DeepSpeed (ZeRO-2, Adam with eps 1e-6, a linear LR
schedule) on a swapped Mixtral at ep_size = the world size, 8 sequences per step over the world.

    torchrun --nproc_per_node W hf_trainer_reshard_worker.py OUT_DIR save|resume [OUT_DIR save|resume ...]

save: 3 steps, a checkpoint at step 2 (OUT_DIR/run/checkpoint-2); writes reference.pt, every parameter after step 3
(HF names, all experts gathered): the uninterrupted run's next step after the checkpoint.
resume: from other starting weights, trainer.train(resume_from_checkpoint=OUT_DIR/run/checkpoint-2) to step 3 in
this world; writes resumed.pt the same way. Several runs (two arguments each) go one after another in the same
processes.
"""
import os
import sys

import torch

import moe_plugin.integrations.transformers as hf_moe  # first: hides an unloadable torchaudio from transformers
from helpers.workers.hf_trainer_worker import build_model, dataset


def main(out_dir, mode):
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments
    world = int(os.environ["WORLD_SIZE"])
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
                 "optimizer": {"type": "Adam", "params": {"lr": "auto", "eps": "auto", "torch_adam": True}},
                 "zero_optimization": {"stage": 2}}
    args = TrainingArguments(output_dir=os.path.join(out_dir, "run"), use_cpu=True, deepspeed=ds_config,
                             per_device_train_batch_size=8 // world, max_steps=3, learning_rate=1e-2,
                             lr_scheduler_type="linear", warmup_steps=2, adam_epsilon=1e-6, save_strategy="steps", save_steps=2,
                             max_grad_norm=0.0, report_to=[], seed=0, logging_strategy="no")
    model = hf_moe.swap_moe_blocks(build_model(), ep_size=world)
    if mode == "resume":    # other starting weights: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, "run", "checkpoint-2") if mode == "resume" else None)
    whole = hf_moe.hf_state_dict(model)   # a collective: every rank gathers
    if dist.get_rank() == 0:
        torch.save({"params": whole, "step": trainer.state.global_step,
                    "lr": trainer.lr_scheduler.get_last_lr()[0]}, os.path.join(out_dir, f"{mode}d.pt"))


if __name__ == "__main__":
    from helpers.workers import leave_together
    for at in range(1, len(sys.argv), 2):
        main(sys.argv[at], sys.argv[at + 1])
    leave_together()
