"""Swapped HF models with ep_size 2 on 2 gloo processes equal one process (the unswapped HF model); HF Trainer
with the expert bias callback, in a process of its own."""
import tempfile

import pytest
import torch

from hf_helpers import (FAMILIES, assert_close_rel, bias_sign_step, build_model, forward_backward, hf_moe,
                        needs_transformers, tokens, transformers, unbiased_deepseek)
from launch import run_workers

pytestmark = [needs_transformers, pytest.mark.timeout(600)]
TOL = 1e-5
LENGTHS = (13, 7)   # the ranks hold different numbers of tokens


def rank_ids(seed: int, rank: int):
    return tokens(seed + 1 + rank, batch=2, length=LENGTHS[rank])


def _ep_worker(rank, world_size, family, seed, export_dir):
    torch.set_num_threads(1)
    model = hf_moe.swap_moe_blocks(build_model(family, seed), ep_size=2)
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, hf_moe.HFMoEBlock)}
    assert all(b.moe.is_parallel and b.moe.experts.w1_EDH.shape[0] == b.moe.config.num_experts // 2
               for b in blocks.values())
    out = forward_backward(model, rank_ids(seed, rank))
    shared = {n: p.grad for n, p in model.named_parameters() if not any(n.startswith(f"{b}.") for b in blocks)}
    layer_grads = {b: {n: p.grad for n, p in block.moe.named_parameters()} for b, block in blocks.items()}
    hf_moe.export_hf(model, export_dir)
    # numpy arrays travel by value: torch tensors would go through shared memory that dies with this process
    result = dict(logits=out.logits, loss=out.loss, shared=shared, layers=layer_grads)
    return _apply(result, lambda t: t.detach().numpy())


def _apply(tree, fn):
    if isinstance(tree, dict):
        return {k: _apply(v, fn) for k, v in tree.items()}
    return fn(tree)


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_on_two_processes_equals_one_process_and_exports_every_expert(family, fresh_seed, tmp_path):
    ranks = run_workers(_ep_worker, 2, family, fresh_seed, str(tmp_path / "export"), timeout=300)
    ranks = [_apply(r, torch.from_numpy) for r in ranks]

    model = build_model(family, fresh_seed)
    model.zero_grad()
    total = 0
    for rank, result in enumerate(ranks):
        out = model(rank_ids(fresh_seed, rank), labels=rank_ids(fresh_seed, rank), output_router_logits=True)
        assert_close_rel(result["logits"], out.logits, TOL, f"rank {rank} logits")
        assert_close_rel(result["loss"], out.loss, TOL, f"rank {rank} loss")
        total = total + out.loss
    total.backward()   # the sum of the ranks' losses: what their gradients add up to

    family_entry = hf_moe.FAMILIES[family]
    grads = {n: sum(r["shared"][n] for r in ranks) for n in ranks[0]["shared"]}
    for block, names in ranks[0]["layers"].items():
        full = {n: (torch.cat([r["layers"][block][n] for r in ranks]) if n.startswith("experts.")
                    else sum(r["layers"][block][n] for r in ranks)) for n in names}
        full = {m.layer: full.get(m.layer, torch.zeros(0)) for m in family_entry.weights}
        grads.update({f"{block}.{k}": v for k, v in hf_moe.layer_to_hf(family_entry, full).items()})
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, TOL, f"grad of {name}")

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ids = rank_ids(fresh_seed, 0)
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert_close_rel(loaded(ids).logits, model(ids).logits, TOL, "logits of the exported model")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


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
