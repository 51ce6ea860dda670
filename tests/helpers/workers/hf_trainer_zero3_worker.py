"""Run under torchrun by test_deepspeed_zero3.py: transformers.Trainer with a ZeRO stage-3 DeepSpeed config
(CPU, gloo) on a tiny Mixtral, either with HF's own blocks ("hf"), swapped with swap_moe_blocks and a "moe"
section in the config ("ours"), or swapped by a "moe" section with ep_size 2 ("ours_ep2"); then
trainer.save_model with stage3_gather_16bit_weights_on_model_save. Several modes run one after the other in the same
processes (one start of torch, transformers and DeepSpeed), each from the same seeds.

    torchrun --nproc_per_node 2 hf_trainer_zero3_worker.py OUT_DIR hf|ours|ours_ep2[,MODE...] STEPS

Writes OUT_DIR/MODE/result<rank>.json (losses, block classes) and OUT_DIR/MODE/final (save_model's folder).
"""
import json
import os
import sys

import moe_plugin.integrations.transformers as hf_moe  # first: hides an unloadable torchaudio from transformers
from helpers.workers.hf_trainer_worker import build_model, dataset


def main(out_dir, mode, steps):
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
                 "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
                 # every parameter partitioned (DeepSpeed keeps those under 1e5 elements whole by default)
                 "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                       "stage3_param_persistence_threshold": 0}}
    if mode != "hf":
        ds_config["moe"] = {"backend": "tutel", **({"ep_size": 2} if mode == "ours_ep2" else {})}
    args = TrainingArguments(output_dir=os.path.join(out_dir, "trainer"), use_cpu=True, deepspeed=ds_config,
                             per_device_train_batch_size=4, max_steps=steps, learning_rate=0.5,
                             lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], seed=0)
    model = build_model()
    if mode == "ours":
        model = hf_moe.swap_moe_blocks(model)
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "final"))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    with open(os.path.join(out_dir, f"result{dist.get_rank()}.json"), "w") as file:
        blocks = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "moe")})
        json.dump({"losses": losses, "blocks": blocks}, file)


if __name__ == "__main__":
    from helpers.workers import leave_together
    for mode in sys.argv[2].split(","):
        main(os.path.join(sys.argv[1], mode), mode, int(sys.argv[3]))
    leave_together()
