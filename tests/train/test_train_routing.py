"""`moe-plugin train` with the modern routing keys: the bias moves once per step, survives resume."""
import torch

from moe_plugin import checkpoint, train

from helpers.train import ROOT, TINY, run

ROUTING = ["moe.router=sigmoid", "moe.num_experts=8", "moe.top_k=4", "moe.num_groups=4", "moe.topk_groups=2",
           "moe.route_scale=2.0", "moe.shared_hidden_size=24", "moe.expert_bias_update_rate=0.01",
           "moe.aux_loss=seq", "moe.capacity_factor=0"]


def final_biases(path):
    state = checkpoint.nest(checkpoint.full_state(path))["model"]   # a sharded checkpoint folder, read whole
    return {k: v for k, v in state.items() if k.endswith("router.expert_bias_E")}


def test_bias_moves_once_per_step_and_resumes_exactly(tmp_path, fresh_seed):
    common = [*TINY, *ROUTING, "train.steps=8", "train.eval_every=4", "train.checkpoint_every=4", "log.every=1",
              "log.plots=false", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    full, records = run(tmp_path, *common, name="full")
    biases = final_biases(tmp_path / "full" / "checkpoints" / "step_000008")
    assert len(biases) == 1 and records[-1]["step"] == 8
    for bias in biases.values():
        steps = bias / 0.01      # 8 steps of +-rate (or 0 for an expert exactly at the mean)
        assert torch.allclose(steps, steps.round(), atol=1e-3) and float(steps.abs().max()) <= 8 + 1e-3
        assert float(steps.abs().max()) >= 1
    run(tmp_path, *common, "train.stop_at=4", name="split")
    resumed, _ = run(tmp_path, *common, "train.resume=latest", name="split")
    assert resumed["param_sha256_per_rank"] == full["param_sha256_per_rank"]
    split = final_biases(tmp_path / "split" / "checkpoints" / "step_000008")
    assert all(torch.equal(split[k], biases[k]) for k in biases)


def test_bad_routing_key_names_the_key():
    import pytest
    with pytest.raises(ValueError, match=r"moe section: MoEConfig.topk_groups=3 is invalid"):
        train.moe_config(train.load_config(None, [*TINY, "moe.num_groups=2", "moe.topk_groups=3"]))


def test_fine_grained_experiment_is_deepseek_style_and_trains(tmp_path):
    path = ROOT / "configs" / "experiments" / "fine_grained.yaml"
    cfg = train.load_config(str(path), [])
    moe = train.moe_config(cfg)
    assert moe.num_experts >= 32 and moe.top_k >= 4 and moe.router == "sigmoid" and moe.num_groups > 1
    assert moe.topk_groups < moe.num_groups and moe.shared_hidden_size > 0 and moe.route_scale != 1.0
    assert moe.expert_bias_update_rate > 0 and moe.aux_loss == "none"
    cfg = train.load_config(str(path), ["train.steps=3", "train.eval_every=3", "train.eval_batches=1",
                                        "train.batch_size=2", "log.plots=false", "log.progress=false",
                                        f"log.out_dir={tmp_path}"])
    assert train.train(cfg)["steps"] == 3
