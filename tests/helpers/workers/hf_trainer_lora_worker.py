"""Run under torchrun by test_peft_trainer.py: the README's LoRA recipe (a tiny Mixtral swapped, PEFT's LoRA on the
experts by HF's names and on attention, transformers.Trainer under DeepSpeed ZeRO-2, CPU and gloo).

    torchrun --nproc_per_node 2 hf_trainer_lora_worker.py OUT_DIR STEPS [EP_SIZE]

Writes batch<rank>.pt (the first batch this rank trained on), adapters<rank>_step1.pt and adapters<rank>.pt (the
trainable parameters after the first step and at the end), adapter/ (trainer.save_model's PEFT folder), checkpoint/
(DeepSpeed's engine checkpoint) and result<rank>.json (losses, trainable names, whether load_checkpoint restored the
adapters after they were zeroed, the checkpoint's files). With EP_SIZE 2 (the experts split over the 2 ranks) it also
writes logits<rank>.pt (the trained model's logits on batch<rank>.pt) and, in result<rank>.json, whether
PEFT's set_peft_model_state_dict of the saved adapter brought this rank's adapters back.
"""
import json
import os
import sys

import torch

import moe_plugin.integrations.transformers as hf_moe  # first: hides an unloadable torchaudio from transformers
from helpers.workers.hf_trainer_worker import build_model, dataset

LR = 0.05


def lora_config():
    import peft
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def peft_model(swap: bool, ep_size: int = 1):
    """The tiny Mixtral with fixed LoRA draws; swapped (through our layer) or HF's own."""
    import peft
    model = build_model()
    if swap:
        model = hf_moe.swap_moe_blocks(model, ep_size=ep_size)
    torch.manual_seed(3)
    return peft.get_peft_model(model, lora_config())


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def main(out_dir, steps, ep_size=1):
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
                 "optimizer": {"type": "SGD", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 2}}
    args = TrainingArguments(output_dir=os.path.join(out_dir, "trainer"), use_cpu=True, deepspeed=ds_config,
                             per_device_train_batch_size=4, max_steps=steps, learning_rate=LR,
                             lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], seed=0)
    assert args.device is not None and dist.is_initialized()   # DeepSpeed's process group, made by the arguments
    model = peft_model(swap=True, ep_size=ep_size)
    rank = dist.get_rank()
    batches = []
    model.base_model.model.register_forward_pre_hook(
        lambda module, a, kw: batches.append(kw["input_ids"].clone()), with_kwargs=True)

    class AfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                torch.save(batches[0], os.path.join(out_dir, f"batch{rank}.pt"))
                torch.save(trainable(model), os.path.join(out_dir, f"adapters{rank}_step1.pt"))

    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[AfterFirstStep()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    final = trainable(model)
    torch.save(final, os.path.join(out_dir, f"adapters{rank}.pt"))
    trainer.save_model(os.path.join(out_dir, "adapter"))
    if ep_size > 1:
        model.eval()
        with torch.no_grad():
            torch.save(model(input_ids=batches[0]).logits, os.path.join(out_dir, f"logits{rank}.pt"))
        reloaded = load_saved_adapter(model, os.path.join(out_dir, "adapter"), final)

    # DeepSpeed's own checkpoint (experts' adapters in its per-expert files) brings the adapters back
    trainer.deepspeed.save_checkpoint(os.path.join(out_dir, "checkpoint"), tag="t")
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.zero_()
    trainer.deepspeed.load_checkpoint(os.path.join(out_dir, "checkpoint"), tag="t", load_module_only=True)
    restored = all(torch.equal(p, final[n]) for n, p in trainable(model).items())
    files = sorted(os.listdir(os.path.join(out_dir, "checkpoint", "t")))
    with open(os.path.join(out_dir, f"result{rank}.json"), "w") as out:
        json.dump({"losses": losses, "trainable": sorted(final), "restored": restored, "files": files,
                   "reloaded": reloaded if ep_size > 1 else None}, out)


def load_saved_adapter(model, folder, final):
    """Whether PEFT's set_peft_model_state_dict of the saved adapter (every expert's factors) brings back this
    rank's trained adapters after they were zeroed."""
    import peft
    import torch.distributed as dist
    from safetensors.torch import load_file
    dist.barrier()    # rank 0 wrote the folder
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.zero_()
    peft.set_peft_model_state_dict(model, load_file(os.path.join(folder, "adapter_model.safetensors")))
    return all(torch.equal(p, final[n]) for n, p in trainable(model).items())


if __name__ == "__main__":
    from helpers.workers import leave_together
    main(sys.argv[1], int(sys.argv[2]), *[int(a) for a in sys.argv[3:]])
    leave_together()
