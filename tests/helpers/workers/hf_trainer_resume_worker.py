"""Run under torchrun by test_deepspeed_hf.py: HF Trainer with DeepSpeed on a swapped model (ep_size 2), 4 steps
saving every 2, then a second Trainer resuming from the step-2 checkpoint to step 4. Writes final<rank>.pt with the
parameters this rank holds at the end of each run.

    torchrun --nproc_per_node 2 hf_trainer_resume_worker.py OUT_DIR [hf_trainer_worker.py's arguments]

hf_trainer_worker.py's runs, if given, follow in the same processes (their start is most of each one's time).
"""
import os
import sys

import torch

import moe_plugin.integrations.transformers as hf_moe  # first: hides an unloadable torchaudio from transformers
from helpers.workers.hf_trainer_worker import build_model, dataset, runs


def trainer(out_dir, resume):
    from transformers import Trainer, TrainingArguments
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
                 "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}},
                 "zero_optimization": {"stage": 1}}
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, deepspeed=ds_config, per_device_train_batch_size=4,
                             max_steps=4, learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="steps",
                             save_steps=2, report_to=[], seed=0, logging_strategy="no")
    model = hf_moe.swap_moe_blocks(build_model(), ep_size=2)
    if resume:    # other starting weights: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
    run = Trainer(model=model, args=args, train_dataset=dataset())
    run.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2") if resume else None)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(out_dir):
    import torch.distributed as dist
    first = trainer(os.path.join(out_dir, "run"), resume=False)
    resumed = trainer(os.path.join(out_dir, "run"), resume=True)
    torch.save({"first": first, "resumed": resumed}, os.path.join(out_dir, f"final{dist.get_rank()}.pt"))


if __name__ == "__main__":
    from helpers.workers import leave_together
    main(sys.argv[1])
    runs(sys.argv[2:])
    leave_together()
