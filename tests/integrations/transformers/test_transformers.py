"""moe_plugin.integrations.transformers against the Hugging Face blocks it replaces (CPU, tiny configs)."""
import copy

import pytest
import torch

from moe_plugin import update_expert_bias
from helpers.compare import assert_close_rel, relative_error
from helpers.hf import (FAMILIES, build_model, family_config, forward_backward, hf_moe, hf_named_grads,
                        needs_transformers, swapped_copy, tokens, transformers)

pytestmark = [needs_transformers, pytest.mark.timeout(300)]
TOL = 1e-5


TOP1_NORMALIZED = {"mixtral": {}, "qwen2_moe": {"norm_topk_prob": True}, "qwen3_moe": {},
                   "olmoe": {"norm_topk_prob": True}, "deepseek_v3": {}}


@pytest.mark.parametrize("family", FAMILIES)
def test_top1_with_normalized_gates_matches_hf(family, fresh_seed):
    """One expert per token with norm_topk_prob (always, for Mixtral): HF's gate is p / p = 1 (times
    DeepSeek-V3's route scale), so the router learns only through the aux loss; the swap does the same."""
    model = build_model(family, fresh_seed, num_experts_per_tok=1, **TOP1_NORMALIZED[family])
    swapped = swapped_copy(model)
    assert all(b.moe.config.normalize_gate == "before_drop"
               for b in swapped.modules() if isinstance(b, hf_moe.HFMoEBlock))
    ids = tokens(fresh_seed + 1)
    expected, actual = forward_backward(model, ids), forward_backward(swapped, ids)
    assert_close_rel(actual.logits, expected.logits, TOL, "logits")
    # the router's true gradient is 0 here (DeepSeek-V3 has no aux loss): both sides leave rounding noise
    # of ~1e-10, so each gradient is held to TOL of the largest gradient of the model
    grads, hf_grads = hf_named_grads(swapped), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in hf_grads.values())
    for name, grad in hf_grads.items():
        assert float((grads[name] - grad).abs().max()) <= TOL * scale, f"grad of {name}"


def test_deepseek_v3_correction_bias_is_carried_over_and_changes_the_choice(fresh_seed):
    model = build_model("deepseek_v3", fresh_seed)
    swapped = swapped_copy(model)
    ids = tokens(fresh_seed + 1)
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            ours = swapped.get_submodule(name.rsplit(".gate.", 1)[0]).moe.router.expert_bias_E
            assert bias.abs().min() > 0 and torch.equal(ours, bias)
    with torch.no_grad():
        with_bias = swapped(ids).logits
        for block in swapped.modules():
            if isinstance(block, hf_moe.HFMoEBlock):
                block.moe.router.expert_bias_E.zero_()
        assert not torch.allclose(swapped(ids).logits, with_bias)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_logits_are_recorded_when_the_model_was_hooked_before_the_swap(family, fresh_seed):
    model = build_model(family, fresh_seed)
    ids = tokens(fresh_seed + 1)
    with torch.no_grad():
        expected = model(ids, output_router_logits=True)       # installs HF's recorder hooks
        hf_moe.swap_moe_blocks(model)
        actual = model(ids, output_router_logits=True)
        plain = model(ids)
    assert len(actual.router_logits) == len(expected.router_logits) > 0
    for ours, theirs in zip(actual.router_logits, expected.router_logits):
        assert_close_rel(ours, theirs, TOL, "router logits")
    assert plain.router_logits is None


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_hf_init_weights_reinitializes_the_swapped_router(family, fresh_seed):
    model = hf_moe.swap_moe_blocks(build_model(family, fresh_seed))
    router = next(m for m in model.modules() if isinstance(m, hf_moe.HFMoEBlock)).moe.router
    with torch.no_grad():
        router.weight_ED.fill_(3.0)
        router.expert_bias_E.fill_(1.0)
    model.init_weights()
    assert router.weight_ED.abs().max() < 1.0 and router.weight_ED.std() > 0
    if family == "deepseek_v3":   # HF zeroes e_score_correction_bias
        assert not router.expert_bias_E.any()


def test_mixtral_aux_loss_with_router_aux_loss_coef(fresh_seed):
    model = build_model("mixtral", fresh_seed, router_aux_loss_coef=0.37)
    swapped = swapped_copy(model)
    ids = tokens(fresh_seed + 1)
    expected, actual = model(ids, labels=ids, output_router_logits=True), swapped(ids, labels=ids,
                                                                                  output_router_logits=True)
    without = swapped(ids, labels=ids)
    assert_close_rel(actual.loss - without.loss, 0.37 * expected.aux_loss, 1e-4, "coef * aux_loss in the loss")
    assert_close_rel(actual.loss, expected.loss, TOL, "loss")


def test_mixtral_jitter_noise_is_applied_in_training_only(fresh_seed):
    model = build_model("mixtral", fresh_seed, router_jitter_noise=0.2)
    swapped = swapped_copy(model)
    ids = tokens(fresh_seed + 1)
    swapped.eval()
    model.eval()
    assert_close_rel(swapped(ids).logits, model(ids).logits, TOL, "eval logits")
    swapped.train()
    torch.manual_seed(fresh_seed)
    first = swapped(ids).logits
    torch.manual_seed(fresh_seed + 7)
    assert not torch.equal(first, swapped(ids).logits)


def test_export_hf_replaces_an_existing_folder(fresh_seed, tmp_path):
    swapped = swapped_copy(build_model("olmoe", fresh_seed))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "stale.txt").write_text("old")
    hf_moe.export_hf(swapped, tmp_path / "export")
    assert not (tmp_path / "export" / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_config_follows_the_hf_config(family):
    config = family_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config)
    cfg = hf_moe.moe_config(model)
    assert (cfg.model_dim, cfg.top_k, cfg.capacity_factor, cfg.activation, cfg.bias) == (40, 3, 0.0, "swiglu", False)
    assert cfg.num_experts == (8 if family == "deepseek_v3" else 6)
    overridden = hf_moe.moe_config(model, capacity_factor=1.25, ep_size=2, a2a="2dh", overlap_degree=2)
    assert (overridden.capacity_factor, overridden.ep_size, overridden.a2a, overridden.overlap_degree) == (
        1.25, 2, "2dh", 2)


def test_family_table_and_lookup():
    assert set(FAMILIES) <= set(hf_moe.FAMILIES)
    model = build_model("qwen3_moe", 0)
    assert hf_moe.family_of(model).model_type == "qwen3_moe"
    assert hf_moe.family_of(torch.nn.Linear(2, 2)) is None


def test_bad_overrides_and_inputs_give_clear_errors(fresh_seed):
    model = build_model("mixtral", fresh_seed)
    with pytest.raises(ValueError, match="no field 'capacity_factr'.*did you mean 'capacity_factor'"):
        hf_moe.swap_moe_blocks(model, capacity_factr=1.0)
    with pytest.raises(ValueError, match="num_experts=7 contradicts the mixtral config"):
        hf_moe.swap_moe_blocks(model, num_experts=7)
    with pytest.raises(ValueError, match=r"MoEConfig.top_k=9 is invalid"):
        hf_moe.swap_moe_blocks(model, top_k=9)
    with pytest.raises(ValueError, match="ep_size"):
        hf_moe.swap_moe_blocks(model, ep_size=4)   # 6 experts over 4 ranks: no layout
    hf_moe.swap_moe_blocks(model)
    with pytest.raises(ValueError, match="has no MixtralSparseMoeBlock"):
        hf_moe.swap_moe_blocks(model)             # already swapped
    with pytest.raises(ValueError, match="model_dim=40"):
        model.model.layers[0].mlp(torch.randn(2, 3, 41))
    relu = build_model("olmoe", fresh_seed, hidden_act="relu")   # gated ReLU: no such activation in the layer
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        hf_moe.swap_moe_blocks(relu)


def test_swapped_bf16_model_stays_bf16_and_close_to_hf(fresh_seed):
    # HF's default grouped_mm needs 16-byte strides in bf16, which width 28 lacks: compare with eager
    model = build_model("qwen3_moe", fresh_seed, dtype=torch.bfloat16, experts_implementation="eager")
    swapped = swapped_copy(model)
    assert {p.dtype for p in swapped.parameters()} == {torch.bfloat16}
    ids = tokens(fresh_seed + 1)
    with torch.no_grad():
        expected, actual = model(ids).logits.float(), swapped(ids).logits.float()
    assert relative_error(actual, expected) < 0.05


@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_model_under_bf16_autocast_is_as_close_to_fp32_as_hf_is(family, fresh_seed):
    """fp32 parameters under torch.autocast(bf16), as GPU training runs: against the exact fp32 result, the
    swapped model's logits and gradients are no further off than HF's own model under the same autocast
    (twice its error, or bf16's resolution when HF happens to be closer); gradients stay fp32."""
    model = build_model(family, fresh_seed, experts_implementation="eager")   # HF's grouped_mm: 16-byte strides
    swapped = swapped_copy(model)
    ids = tokens(fresh_seed + 1)

    def run(m, autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(ids, labels=ids)
        m.zero_grad(set_to_none=True)
        out.loss.backward()
        return out.logits.detach().float(), {n: p.grad.clone() for n, p in m.named_parameters()}

    exact_logits, exact_grads = run(model, False)
    hf_logits, hf_grads = run(model, True)
    ours_logits, _ = run(swapped, True)
    ours_grads = hf_named_grads(swapped)
    assert {g.dtype for g in ours_grads.values()} == {torch.float32}

    def grad_error(grads):
        diff = torch.cat([(grads[n].double() - g.double()).flatten() for n, g in exact_grads.items()])
        return float(diff.norm() / torch.cat([g.double().flatten() for g in exact_grads.values()]).norm())

    hf_error, ours_error = relative_error(hf_logits, exact_logits), relative_error(ours_logits, exact_logits)
    assert ours_error <= max(2 * hf_error, 0.03), f"logits: ours {ours_error:.3g}, HF {hf_error:.3g}"
    hf_error, ours_error = grad_error(hf_grads), grad_error(ours_grads)
    assert ours_error <= max(2 * hf_error, 0.02), f"gradients: ours {ours_error:.3g}, HF {hf_error:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_of_a_swapped_model_loads_in_plain_transformers(family, fresh_seed, tmp_path):
    """HF Trainer and users save with model.save_pretrained: the folder holds HF names and layouts, so plain
    from_pretrained gives the same model (also when a state dict is passed, as Trainer does, and for a copy)."""
    swapped = swapped_copy(build_model(family, fresh_seed))
    with torch.no_grad():    # the copy's own weights, not the original's, must be what its save writes
        for p in swapped.parameters():
            p.add_(0.01 * torch.randn_like(p))
    copy_of_it = copy.deepcopy(swapped)
    ids = tokens(fresh_seed + 1)
    for i, (model, kwargs) in enumerate([(swapped, {}), (swapped, {"state_dict": swapped.state_dict()}),
                                         (copy_of_it, {})]):
        model.save_pretrained(tmp_path / str(i), **kwargs)
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / str(i), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert not any(isinstance(m, hf_moe.HFMoEBlock) for m in loaded.modules())
        with torch.no_grad():
            assert_close_rel(loaded(ids).logits, model(ids).logits, TOL, f"logits after save {i}")


@pytest.mark.parametrize("block_class", ["HFMoEBlock", "DeepSpeedHFMoEBlock"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_swapped_model_loads_a_state_dict_in_hf_names(family, block_class, fresh_seed):
    """load_state_dict takes the blocks in HF's names and layouts (an unswapped model's state_dict(), or
    hf_state_dict of a swapped one), strictly, for the default block (HFMoEBlock) and DeepSpeed's MoE subclass
    (what DeepSpeed's paths build); its own names still load."""
    options = {}
    if block_class == "DeepSpeedHFMoEBlock":
        pytest.importorskip("deepspeed")
        from moe_plugin.integrations.deepspeed.hf import DeepSpeedHFMoEBlock
        options = {"block_class": DeepSpeedHFMoEBlock}
    hf_model = build_model(family, fresh_seed)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    trained = swapped_copy(hf_model, **options)
    ids = tokens(fresh_seed + 2)
    with torch.no_grad():
        expected = trained(ids).logits
    for source in (hf_model.state_dict(), hf_moe.hf_state_dict(trained), trained.state_dict()):
        resumed = swapped_copy(build_model(family, fresh_seed + 1), **options)
        resumed.load_state_dict(source, strict=True)
        with torch.no_grad():
            assert torch.equal(resumed(ids).logits, expected)
        assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), trained.state_dict().values()))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_the_kv_cache_equals_hf(family, fresh_seed):
    """Inference as users run it after training: generate() decodes token by token (a few tokens per
    block call, through HF's KV cache); greedy output equals the unswapped model's."""
    model = build_model(family, fresh_seed).eval()
    swapped = swapped_copy(model).eval()
    ids = tokens(fresh_seed + 1, batch=2, length=6)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(swapped.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), expected)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_hf_loss_and_gradients(family, reentrant, fresh_seed):
    """model.gradient_checkpointing_enable(): the blocks run again in backward; loss and every gradient still
    equal the unswapped model's under the same checkpointing."""
    model = build_model(family, fresh_seed)
    swapped = swapped_copy(model)
    for m in (model, swapped):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    ids = tokens(fresh_seed + 1)
    losses = []
    for m in (model, swapped):
        out = m(ids, labels=ids, use_cache=False)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert_close_rel(losses[1], losses[0], TOL, "loss")
    grads = hf_named_grads(swapped)
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, TOL, f"grad of {name}")


def test_bias_balancing_under_gradient_checkpointing_moves_the_bias_as_without(fresh_seed):
    """Recomputing the blocks counts their choices twice: the sign update of the expert bias is unchanged."""
    moved = []
    for checkpointing in (False, True):
        swapped = swapped_copy(build_model("deepseek_v3", fresh_seed), expert_bias_update_rate=0.01)
        if checkpointing:
            swapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        swapped.train()
        ids = tokens(fresh_seed + 1)
        swapped(ids, labels=ids, use_cache=False).loss.backward()
        before = [b.clone() for n, b in swapped.named_buffers() if n.endswith("expert_bias_E")]
        assert update_expert_bias(swapped) == 2
        after = [b for n, b in swapped.named_buffers() if n.endswith("expert_bias_E")]
        moved.append([a - b for a, b in zip(after, before)])
    assert all(m.abs().sum() > 0 for m in moved[0])
    assert all(torch.equal(a, b) for a, b in zip(*moved))


def test_torch_compile_of_a_whole_swapped_model_gives_hf_loss_and_gradients(fresh_seed):
    """torch.compile(model) as users compile HF models (DeepSeek-V3: groups, bias, shared experts; a dense layer and
    an MoE layer, as each layer is one more copy of the code to compile)."""
    model = build_model("deepseek_v3", fresh_seed, num_hidden_layers=2)
    swapped = swapped_copy(model)
    ids = tokens(fresh_seed + 1)
    out = torch.compile(swapped)(ids, labels=ids, use_cache=False)
    out.loss.backward()
    expected = model(ids, labels=ids, use_cache=False)
    expected.loss.backward()
    assert_close_rel(out.loss, expected.loss, TOL, "loss")
    grads = hf_named_grads(swapped)
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, TOL, f"grad of {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_whole_swapped_model_pickles_into_a_fresh_interpreter(family, fresh_seed, tmp_path):
    """torch.save(model) (and multiprocessing, which pickles too): loaded by a new Python, same logits."""
    import subprocess
    import sys
    swapped = swapped_copy(build_model(family, fresh_seed))
    ids = tokens(fresh_seed + 1)
    torch.save({"model": swapped, "ids": ids}, tmp_path / "model.pt")
    script = ("import torch, moe_plugin.integrations.transformers\n"
              f"saved = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
              "with torch.no_grad():\n"
              f"    torch.save(saved['model'](saved['ids']).logits, {str(tmp_path / 'logits.pt')!r})\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), swapped(ids).logits)
