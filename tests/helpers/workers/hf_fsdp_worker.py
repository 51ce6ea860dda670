"""Run under torchrun by test_transformers_fsdp.py: a swapped HF model sharded with fully_shard_moe, trained
by transformers.Trainer with Accelerate's FSDP2 (fsdp_version 2), CPU and gloo.

    torchrun --nproc_per_node 2 hf_fsdp_worker.py OUT_DIR EP_SIZE STEPS SAVE_MODEL    (EP_SIZE 0: HF's own blocks)

Writes result<rank>.json: the logged losses, the block classes, for a swapped model the largest difference
between the trained model's logits and those of the folder export_hf wrote from its FSDP2 shards, loaded by plain
from_pretrained, whether Accelerate's full state dict (save_model's) is the trained model's, with SAVE_MODEL 1
the logits difference for trainer.save_model's folder, and at EP_SIZE 2 how far a Trainer run resumed from its
sharded step-2 checkpoint ends from the uninterrupted run (AdamW). A rank waiting more than
SAVE_TIMEOUT s in save_model prints where every thread is and exits (a hang fails the test, with the place).
"""
import json
import os
import sys

import torch

import moe_plugin.integrations.transformers as hf_moe  # first: hides an unloadable torchaudio from transformers
from helpers.workers.hf_trainer_worker import build_model, dataset


def on_fsdp(trainer):
    """Accelerate 1.15 takes its FSDP path only on accelerator devices (on CPU it falls back to DDP, which
    cannot hold DTensors): here, on CPU, the state is switched to FSDP with the plugin Trainer made from
    fsdp_config, so that Accelerate's and Trainer's FSDP2 code (fsdp2_prepare_model, which leaves a model that
    is already an FSDPModule as it is; the FSDP2 state dicts of save_model) runs as it does on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.FSDP:
        # PartialState's too, as AcceleratorState's own init does: every later AcceleratorState() copies it back
        state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        trainer.is_fsdp_enabled = True


SAVE_TIMEOUT = 120


def main(out_dir, ep_size, steps, save_model):
    import faulthandler
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments
    from moe_plugin.parallel import fully_shard_moe

    args = TrainingArguments(output_dir=os.path.join(out_dir, "trainer"), use_cpu=True, fsdp="full_shard",
                             fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                          # a model sharded beforehand: Accelerate wraps nothing more
                                          **({"auto_wrap_policy": "NO_WRAP"} if ep_size else {})},
                             per_device_train_batch_size=4, max_steps=steps, learning_rate=0.5, optim="sgd",
                             lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], seed=0)
    model = build_model()
    if ep_size:   # after TrainingArguments: distributed is up
        model = fully_shard_moe(hf_moe.swap_moe_blocks(model, ep_size=ep_size))
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    on_fsdp(trainer)
    trainer.train()
    rank = dist.get_rank()
    result = {"losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
              "blocks": sorted({type(m).__name__ for m in model.modules() if hasattr(m, "moe")})}
    if save_model:
        faulthandler.dump_traceback_later(SAVE_TIMEOUT, exit=True)
        trainer.save_model(os.path.join(out_dir, "saved"))
        faulthandler.cancel_dump_traceback_later()
        result["save_model_logits_diff"] = loaded_logits_diff(model, os.path.join(out_dir, "saved"))
    if ep_size:   # export_hf on every rank: it gathers the FSDP2 shards and the experts
        if ep_size == 1:
            result["full_state_dict_equal"] = full_state_dict_equal(trainer, model)
        else:   # Trainer's FSDP2 checkpoints, sharded through DCP: a run resumed at step 2 ends as the whole run
            run = os.path.join(out_dir, "checkpointed")
            first, resumed = (checkpointed_run(run, ep_size, resume) for resume in (False, True))
            result["resumed_difference"] = max((first[n] - resumed[n]).abs().max().item() for n in first)
            result["resumed_moved"] = max((first[n] - resumed["start " + n]).abs().max().item() for n in first)
            try:   # FULL_STATE_DICT checkpoints would save, then fail to resume: refused at the first save
                checkpointed_run(os.path.join(out_dir, "full"), ep_size, False, "FULL_STATE_DICT")
            except ValueError as error:
                result["full_checkpoint_refused"] = str(error)
        hf_moe.export_hf(model, os.path.join(out_dir, "exported"))
        result["export_logits_diff"] = loaded_logits_diff(model, os.path.join(out_dir, "exported"))
    with open(os.path.join(out_dir, f"result{rank}.json"), "w") as file:
        json.dump(result, file)


def checkpointed_run(out_dir, ep_size, resume, state_dict_type="SHARDED_STATE_DICT"):
    """4 AdamW steps under Trainer with Accelerate's FSDP2, checkpoints (SHARDED_STATE_DICT) every 2; with resume,
    from other starting weights, resumed from checkpoint-2. {name: this rank's shard at the end} (with resume
    also {"start " + name: at the start})."""
    from transformers import Trainer, TrainingArguments
    from moe_plugin.parallel import fully_shard_moe
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, fsdp="full_shard",
                             fsdp_config={"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy":
                                          "NO_WRAP", "state_dict_type": state_dict_type},
                             per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2, optim="adamw_torch",
                             lr_scheduler_type="constant", save_strategy="steps", save_steps=2, report_to=[], seed=0,
                             logging_strategy="no")
    model = build_model()
    if resume:    # other starting weights: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
    model = fully_shard_moe(hf_moe.swap_moe_blocks(model, ep_size=ep_size))
    start = {"start " + n: p.to_local().detach().clone() for n, p in model.named_parameters()} if resume else {}
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    on_fsdp(trainer)
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2") if resume else None)
    return {**start, **{n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def full_state_dict_equal(trainer, model):
    """Whether Accelerate's FSDP2 full state dict (what save_model hands to save_pretrained; torch's
    get_model_state_dict) holds, on rank 0, the keys and tensors of the model's state dict with every shard
    gathered (the experts: this rank's); None on other ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    state = trainer.accelerator.get_state_dict(model)
    live = {key: (t.full_tensor() if isinstance(t, DTensor) else t) for key, t in model.state_dict().items()}
    if dist.get_rank() != 0:
        return None
    return sorted(state) == sorted(live) and all(torch.equal(state[key], live[key]) for key in live)


def loaded_logits_diff(model, directory):
    """Rank 0 loads the folder with plain transformers and compares its logits with the trained model's on the
    same tokens (None on other ranks; every rank runs the trained model)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        live = model(input_ids=ids).logits          # every rank: FSDP2 gathers, the experts exchange tokens
        if dist.get_rank() != 0:
            return None
        loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
        return float((loaded(input_ids=ids).logits - live).abs().max())


if __name__ == "__main__":
    from helpers.workers import leave_together
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    leave_together()
