"""Run under torchrun by test_deepspeed_hf.py: the README's recipe (a swapped HF model, transformers.Trainer,
TrainingArguments(deepspeed=...), CPU and gloo), with what the test checks written to OUT_DIR.

    torchrun --nproc_per_node 2 hf_trainer_worker.py OUT_DIR ZERO_STAGE EP_SIZE STEPS [OUT_DIR ZERO_STAGE ...]

Writes batch<rank>.pt (the first batch this rank trained on), step1.pt (every parameter after the first step in
HF names, all experts gathered) and result<rank>.json (losses, whether the engine runs the blocks as MoE, its ZeRO
stage, the experts each block holds, how far plain transformers' load of trainer.save_model's folder is from the
trained model), and params<rank>.pt (the parameters this rank holds at the end). Several runs (four arguments each)
go one after another in the same processes, each from a fresh model and Trainer.
"""
import json
import os
import sys

import torch

import moe_plugin.integrations.transformers as hf_moe  # first: hides an unloadable torchaudio from transformers

VOCAB, LENGTH = 61, 13


def build_model():
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=40, intermediate_size=28, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=3,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def dataset(size=64):
    """Sequences t[i+1] = (3 t[i] + 1) mod VOCAB from random starts: a pattern the model can learn."""
    starts = torch.randint(0, VOCAB, (size,), generator=torch.Generator().manual_seed(1))
    rows = [starts]
    for _ in range(LENGTH - 1):
        rows.append((3 * rows[-1] + 1) % VOCAB)
    ids = torch.stack(rows, dim=1)
    return [{"input_ids": row, "labels": row} for row in ids]


def main(out_dir, stage, ep_size, steps):
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
                 # DeepSpeed builds the optimizer: it puts the expert parameters in their own groups (ZeRO 1/2 needs it)
                 "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
                 "zero_optimization": {"stage": stage}}
    args = TrainingArguments(output_dir=os.path.join(out_dir, "trainer"), use_cpu=True, deepspeed=ds_config,
                             per_device_train_batch_size=4, max_steps=steps, learning_rate=0.5,
                             lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], seed=0)
    model = hf_moe.swap_moe_blocks(build_model(), ep_size=ep_size)   # after TrainingArguments: distributed is up
    rank = dist.get_rank()
    batches = []
    model.register_forward_pre_hook(lambda module, a, kw: batches.append(kw["input_ids"].clone()), with_kwargs=True)

    class AfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                full = hf_moe.hf_state_dict(model)   # a collective: every rank gathers
                torch.save(batches[0], os.path.join(out_dir, f"batch{rank}.pt"))
                if rank == 0:
                    torch.save(full, os.path.join(out_dir, "step1.pt"))

    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[AfterFirstStep()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, os.path.join(out_dir, f"params{rank}.pt"))
    final = os.path.join(out_dir, "final")
    trainer.save_model(final)       # save_pretrained on rank 0: HF names unless the experts are spread
    reload_error = None
    if rank == 0 and ep_size == 1:
        from transformers import MixtralForCausalLM
        probe = torch.stack([row["input_ids"] for row in dataset(4)])
        model.eval()
        with torch.no_grad():
            reload_error = (MixtralForCausalLM.from_pretrained(final)(input_ids=probe).logits
                            - model(input_ids=probe).logits).abs().max().item()
    with open(os.path.join(out_dir, f"result{rank}.json"), "w") as file:
        json.dump({"losses": losses, "has_moe_layers": trainer.model_wrapped.has_moe_layers, "reload_error": reload_error,
                   "engine": type(trainer.model_wrapped).__name__,
                   "zero_stage": trainer.model_wrapped.zero_optimization_stage(),
                   "local_experts": sorted({m.moe.groups.layout.local_experts for m in model.modules()
                                            if hasattr(m, "moe")}),
                   "blocks": sorted({type(m).__name__ for m in model.modules() if hasattr(m, "moe")})}, file)


def runs(arguments):
    """main for each four of arguments (OUT_DIR ZERO_STAGE EP_SIZE STEPS) in turn."""
    for at in range(0, len(arguments), 4):
        main(arguments[at], int(arguments[at + 1]), int(arguments[at + 2]), int(arguments[at + 3]))


if __name__ == "__main__":
    from helpers.workers import leave_together
    runs(sys.argv[1:])
    leave_together()
