"""Run under torchrun by test_peft_trl.py: the README's TRL recipe (a tiny Mixtral swapped onto our layer, TRL's
SFTTrainer given PEFT's LoraConfig on the experts by HF's names and on attention, DeepSpeed ZeRO-2, CPU and gloo).

    torchrun --nproc_per_node 2 trl_sft_lora_worker.py OUT_DIR STEPS

Writes adapters<rank>_init.pt, adapters<rank>_step1.pt and adapters<rank>.pt (the trainable parameters before
training, after the first step and at the end), batch<rank>.pt (the first batch this rank trained on), adapter/
(trainer.save_model's PEFT folder) and result<rank>.json (losses, trainable names).
"""
import json
import os
import sys

import torch

import moe_plugin.integrations.transformers as hf_moe  # first: hides an unloadable torchaudio from transformers
from helpers.workers.hf_trainer_lora_worker import LR, lora_config, trainable
from helpers.workers.hf_trainer_worker import VOCAB, build_model, dataset


def tokenizer():
    """A word-level tokenizer over the tiny model's VOCAB ids (SFTTrainer needs a processing class; the data comes
    tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", unk_token="t0")


def main(out_dir, steps):
    import datasets
    import torch.distributed as dist
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
                 "optimizer": {"type": "SGD", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 2}}
    args = SFTConfig(output_dir=os.path.join(out_dir, "trainer"), use_cpu=True, deepspeed=ds_config, bf16=False,
                     gradient_checkpointing=False, max_length=None, per_device_train_batch_size=4, max_steps=steps,
                     learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
                     save_strategy="no", report_to=[], seed=0)
    model = hf_moe.swap_moe_blocks(build_model())
    rank = dist.get_rank()
    batches = []
    model.register_forward_pre_hook(lambda module, a, kw: batches.append(kw["input_ids"].clone()), with_kwargs=True)
    data = datasets.Dataset.from_dict({"input_ids": [row["input_ids"].tolist() for row in dataset()]})

    class Snapshots(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            torch.save(trainable(model), os.path.join(out_dir, f"adapters{rank}_init.pt"))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                torch.save(batches[0], os.path.join(out_dir, f"batch{rank}.pt"))
                torch.save(trainable(model), os.path.join(out_dir, f"adapters{rank}_step1.pt"))

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer(),
                         peft_config=lora_config(), callbacks=[Snapshots()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    final = trainable(trainer.model)
    torch.save(final, os.path.join(out_dir, f"adapters{rank}.pt"))
    trainer.save_model(os.path.join(out_dir, "adapter"))
    with open(os.path.join(out_dir, f"result{rank}.json"), "w") as out:
        json.dump({"losses": losses, "trainable": sorted(final)}, out)


if __name__ == "__main__":
    from helpers.workers import leave_together
    main(sys.argv[1], int(sys.argv[2]))
    leave_together()
