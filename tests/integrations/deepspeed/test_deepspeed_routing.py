"""The "moe" section's extras (balancing bias, groups, route scale, aux loss, recompute) and the bias
update once per engine.step() with gradient accumulation, on 2 gloo processes (with a global balance loss
whose counts span each step's micro-batches)."""
import pytest
import torch

pytest.importorskip("deepspeed")
import moe_plugin.integrations.deepspeed as dsi  # noqa: E402
from helpers.launch import run_workers

EXTRAS = {"expert_bias_update_rate": 0.01, "num_groups": 2, "topk_groups": 1, "route_scale": 2.0, "aux_loss": "seq",
          "recompute": "experts"}


@pytest.mark.parametrize("key, value", [
    ("expert_bias_update_rate", -0.1), ("expert_bias_update_rate", float("inf")), ("num_groups", 0),
    ("topk_groups", 1.0), ("route_scale", 0), ("route_scale", "2"), ("aux_loss", "none"), ("aux_loss", "z"),
    ("recompute", "all"), ("recompute", True)])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=rf"\"moe\.{key}\"={value!r} is invalid: must be"):
        dsi.read_moe_section({"moe": {"backend": "tutel", key: value}})


@pytest.mark.parametrize("key", sorted(EXTRAS))
def test_extras_need_backend_tutel(key):
    with pytest.raises(ValueError, match=rf"\"moe\.{key}\"={EXTRAS[key]!r} needs \"moe.backend\": \"tutel\""):
        dsi.read_moe_section({"moe": {"backend": "deepspeed", key: EXTRAS[key]}})


def test_extras_reach_the_config():
    assert dsi.read_moe_section({"moe": {"backend": "tutel", **EXTRAS}}) == {"backend": "tutel", **EXTRAS}
    config = dsi.moe_config(8, 16, 4, 1, 2, 1.0, 1.0, 4, True, "relu", True, **EXTRAS)
    assert {key: getattr(config, key) for key in EXTRAS} == EXTRAS
    assert dsi.moe_config(8, 16, 4, 1, 2, 1.0, 1.0, 4, True, "relu", True).aux_loss == "gshard"
    with pytest.raises(ValueError, match="MoEConfig.num_groups=3 is invalid: must divide num_experts=4"):
        dsi.moe_config(8, 16, 4, 1, 2, 1.0, 1.0, 4, True, "relu", True, num_groups=3)


def accumulation_worker(rank, world, accumulation, micro_batches):
    from helpers.deepspeed import batches, setup_worker

    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss
    setup_worker(rank, world)
    section = {"backend": "tutel", "num_experts": 4, "ep_size": 2, "top_k": 2, "capacity_factor": 1.0,
               "min_capacity": 0, "router": "sigmoid", **EXTRAS, "aux_loss": "switch", "aux_loss_scope": "global"}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, "moe": section}
    torch.manual_seed(0)
    engine, _, _, _ = dsi.initialize(model=MoETransformerLM(section, seed=0), config=config)
    routers = [m.router for m in engine.module.modules() if isinstance(m, dsi.DeepSpeedMoELayer)]
    errors, updates = [], 0
    for tokens in batches(200 + rank, micro_batches, batch=4):
        loss = lm_loss(engine, tokens)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        # what the update must consume: every micro-batch since the last one, summed over the ranks
        loads = [router.load_E.clone() for router in routers]
        for load in loads:
            torch.distributed.all_reduce(load)
        # the global balance loss counts the tokens of the step's micro-batches so far, over the ranks
        assert all(router.step_counts_E1[-1] * 2 == load.sum() for router, load in zip(routers, loads))
        before = [router.expert_bias_E.clone() for router in routers]
        engine.step()
        for router, load, bias in zip(routers, loads, before):
            expected = bias if not boundary else bias + 0.01 * torch.sign(load.float().mean() - load.float())
            errors.append(float((router.expert_bias_E - expected).abs().max()))
            assert (router.load_E is None) == boundary and (router.step_counts_E1 is None) == boundary
        updates += boundary
    return max(errors), updates, [router.expert_bias_E.tolist() for router in routers]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("accumulation", [1, 3])
def test_bias_updates_once_per_step_from_every_micro_batch(accumulation):
    results = run_workers(accumulation_worker, 2, accumulation, 6, timeout=800)
    for error, updates, _ in results:
        assert error < 1e-7 and updates == 6 // accumulation
    assert results[0][2] == results[1][2] and any(b != 0 for bias in results[0][2] for b in bias)


def checkpoint_worker(rank, world, directory):
    from helpers.deepspeed import batches, setup_worker

    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss
    setup_worker(rank, world)
    section = {"backend": "tutel", "num_experts": 4, "ep_size": 2, "top_k": 2, "capacity_factor": 1.0,
               "min_capacity": 0, "router": "sigmoid", **EXTRAS}
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, "moe": section}
    engines = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        engines.append(dsi.initialize(model=MoETransformerLM(section, seed=seed), config=config)[0])
    trained, fresh = engines
    for tokens in batches(300 + rank, 3, batch=4):
        trained.backward(lm_loss(trained, tokens))
        trained.step()
    trained.save_checkpoint(directory, tag="biased")
    fresh.load_checkpoint(directory, tag="biased")
    saved, loaded = trained.module.state_dict(), fresh.module.state_dict()
    biases = [[m.router.expert_bias_E for m in e.module.modules() if isinstance(m, dsi.DeepSpeedMoELayer)]
              for e in engines]
    return (sorted(saved) == sorted(loaded), len(biases[0]),
            max(float((saved[k] - loaded[k]).abs().max()) for k in saved),
            max(float((a - b).abs().max()) for a, b in zip(*biases)),
            any(float(bias.abs().max()) > 0 for bias in biases[0]))


@pytest.mark.timeout(900)
def test_engine_checkpoint_carries_the_balancing_bias(tmp_path):
    for same_keys, num_biases, difference, bias_difference, moved in run_workers(
            checkpoint_worker, 2, str(tmp_path), timeout=800):
        assert same_keys and num_biases == 2 and moved
        assert difference == 0.0 and bias_difference == 0.0
