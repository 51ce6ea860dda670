"""HF Trainer with the expert bias callback, in a process of its own (ep_size 2 on 2 gloo processes against one
process, for every family: test_hf_families.py)."""
import tempfile

import pytest
import torch

from helpers.hf import bias_sign_step, needs_transformers, tokens, unbiased_deepseek
from helpers.launch import run_workers

pytestmark = [needs_transformers, pytest.mark.timeout(600)]


def trainer_bias_worker(rank, world, with_callback):
    """One HF Trainer step (no DeepSpeed, learning rate 0) of the unbiased DeepSeek-V3 with the bias on."""
    from transformers import Trainer, TrainingArguments

    from moe_plugin.integrations.transformers import ExpertBiasUpdate, swap_moe_blocks
    model = swap_moe_blocks(unbiased_deepseek(), expert_bias_update_rate=0.01)
    data = [{"input_ids": row, "labels": row} for row in tokens(seed=7, batch=4)]
    batches = []
    model.register_forward_pre_hook(lambda module, a, kw: batches.append(kw["input_ids"].tolist()), with_kwargs=True)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=4,
                             max_steps=1, learning_rate=0.0, save_strategy="no", report_to=[], logging_strategy="no")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[ExpertBiasUpdate()] if with_callback else []).train()
    return {"bias": [m.moe.router.expert_bias_E.tolist() for m in model.modules() if hasattr(m, "moe")],
            "batch": batches[0]}


@pytest.mark.parametrize("with_callback", [True, False])
def test_hf_trainer_updates_the_expert_bias_with_the_callback_only(with_callback):
    """HF Trainer has no bias update of its own: with ExpertBiasUpdate each step moves the bias by the sign rule
    over the step's choices; without it the bias stays (why the README asks for the callback)."""
    from moe_plugin.integrations.transformers import swap_moe_blocks
    report = run_workers(trainer_bias_worker, 1, with_callback, timeout=200)[0]
    reference = swap_moe_blocks(unbiased_deepseek(), expert_bias_update_rate=0.01).train()
    reference(input_ids=torch.tensor(report["batch"]))
    for bias, router in zip(report["bias"], [m.moe.router for m in reference.modules() if hasattr(m, "moe")]):
        load_E = router.take_load()
        expected = 0.01 * bias_sign_step(load_E) if with_callback else 0
        assert torch.allclose(torch.tensor(bias), router.expert_bias_E + expected, atol=1e-7), bias


def trainer_span_worker(rank, world):
    """One HF Trainer step of 3 micro-batches (gradient_accumulation_steps 3) with a global balance loss and
    ExpertBiasUpdate: the first swapped block's step count of tokens after each forward."""
    from transformers import Trainer, TrainingArguments

    from moe_plugin.integrations.transformers import ExpertBiasUpdate, swap_moe_blocks
    model = swap_moe_blocks(unbiased_deepseek(), aux_loss_scope="global", aux_loss="switch", aux_loss_coef=0.01)
    router = next(m.moe.router for m in model.modules() if hasattr(m, "moe"))
    data = [{"input_ids": row, "labels": row} for row in tokens(seed=7, batch=6)]
    counted = []
    model.register_forward_hook(lambda *_: counted.append(int(router.step_counts_E1[-1])))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=3, max_steps=1, learning_rate=0.0, save_strategy="no",
                             report_to=[], logging_strategy="no")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[ExpertBiasUpdate()]).train()
    return counted, tokens(seed=7, batch=6).numel()


def test_hf_trainer_s_steps_span_a_global_balance_loss_over_their_micro_batches():
    """With the callback, a global balance loss counts over the optimizer step's micro-batches so far."""
    counted, step_tokens = run_workers(trainer_span_worker, 1, timeout=200)[0]
    assert counted == [step_tokens // 3, 2 * step_tokens // 3, step_tokens], counted
