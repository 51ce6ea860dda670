"""Run under torchrun by test_deepspeed_hook.py: training scripts that never name moe_plugin, given only the path
of a DeepSpeed JSON holding a "moe" section; moe_plugin_deepspeed_hook.pth (installed with moe_plugin) makes the
section act.

    torchrun --nproc_per_node 2 hook_worker.py OUT_DIR DS_JSON {trainer,accelerate} STEPS

trainer: transformers.Trainer with TrainingArguments(deepspeed=DS_JSON).
accelerate: Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DS_JSON)), a torch Adam made from
model.parameters() before accelerator.prepare, and a plain loop.
Rank 0 then trains a copy of the unswapped model in one process with torch Adam on both ranks' batches (what it
recorded) and writes result.json: the run's losses (mean over ranks) and the reference's, the MoE block classes,
whether the engine has MoE layers, whether the adapter was imported before training, and whether the experts
differ between ranks.
"""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

# This environment's torchaudio cannot load next to torch 2.13 and transformers imports it when installed;
# moe_plugin.integrations.transformers hides it (DESIGN.md). It enables nothing: see "adapter_before".
import moe_plugin.integrations.transformers  # noqa: F401

from helpers.workers.hf_trainer_worker import build_model, dataset  # noqa: E402

LR, BATCH = 0.01, 4


def with_trainer(model, out_dir, ds_json, steps):
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=os.path.join(out_dir, "trainer"), use_cpu=True, deepspeed=ds_json,
                             per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=LR,
                             lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    return trainer.model_wrapped, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def with_accelerate(model, out_dir, ds_json, steps):
    from accelerate import Accelerator, DeepSpeedPlugin
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_json))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    engine, optimizer = accelerator.prepare(model, optimizer)
    rows = dataset()
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        start = (step * world + rank) * BATCH
        ids = torch.stack([row["input_ids"] for row in rows[start:start + BATCH]])
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return engine, losses


def one_process(model, batches_by_rank):
    """Losses of torch Adam on the ranks' batches concatenated, step by step (equal token counts: the mean of the
    ranks' losses, and the ranks' mean gradient)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step_batches in zip(*batches_by_rank):
        ids = torch.cat(step_batches)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(out_dir, ds_json, how, steps):
    adapter_before = "moe_plugin.integrations.deepspeed" in sys.modules
    model = build_model()
    reference = copy.deepcopy(model)
    batches = []
    model.register_forward_pre_hook(lambda module, a, kw: batches.append(kw["input_ids"].clone()), with_kwargs=True)
    engine, losses = (with_trainer if how == "trainer" else with_accelerate)(model, out_dir, ds_json, steps)
    every_batch = [None] * dist.get_world_size()
    dist.all_gather_object(every_batch, batches)
    expert = next(p for n, p in model.named_parameters() if ".experts." in n).detach()
    experts = [torch.zeros_like(expert) for _ in every_batch]
    dist.all_gather(experts, expert.contiguous())
    if dist.get_rank() == 0:
        result = {"losses": losses, "reference": one_process(reference, every_batch),
                  "blocks": sorted({type(m).__name__ for m in model.modules() if "moeblock" in type(m).__name__.lower()}),
                  "has_moe_layers": engine.has_moe_layers, "adapter_before": adapter_before,
                  "experts_differ": not torch.equal(experts[0], experts[1])}
        with open(os.path.join(out_dir, "result.json"), "w") as file:
            json.dump(result, file)


if __name__ == "__main__":
    from helpers.workers import leave_together
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    leave_together()
