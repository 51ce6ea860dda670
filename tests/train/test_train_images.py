"""`moe-plugin train` on images (configs/experiments/swinv2_moe.yaml): the digits data, SwinV2-MoE built through
upcycle and its dense twin, metrics, plots, checkpoints and exact resume, config errors.

What this module tests (moved here from the README):

Tested (tests/train/test_train_images.py: about 40 s, plus about 30 s for the slow-marked torchrun test, on this
machine when it was less loaded; up to 2.5× that under load): the split (per class, disjoint, complete), augmentation and the
exactly resumable image stream; a tiny SwinV2-MoE run learns and writes every output, its checkpoint's model
gives the run's last validation loss and accuracy, the evaluation's mean over images (a smaller last batch)
equals a plain per-image computation, and `hf_model/` loads back (load_upcycled) to the same logits; the
trainer's model equals `upcycle()` applied by hand to the dense Swinv2 of the same seed, with MoE in exactly
blocks 5 and 7 (of the tests' 8-block model) and the moe section's settings; the shipped YAML, unmodified,
puts MoE in exactly blocks 5, 7 and 9 with its moe section's settings (planned on the meta device); the
dense twin (`upcycle=null`) has no MoE layer and its `hf_model/` loads with plain `from_pretrained`;
upcycling that dense run starts at its validation loss and accuracy; stop-and-resume gives bit-exactly the
uninterrupted run's records and parameters; 22 bad configs
(19 image, 3 language-model ones: image keys, `upcycle` without hf, swinv2 without `data.task: image`) stop
with messages naming the key; `--print-config`. Slow-marked: `torchrun` 2 processes with
`parallel.ep_size=2` (each process holds its own experts, the load counts both processes' images, the
checkpoint holds every expert and gives the run's validation loss in one process).
"""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from moe_plugin import MoELayer, checkpoint, train
from moe_plugin.train.data import DataConfig, make_data
from moe_plugin.train.data.images import NUM_CLASSES, load_digits, split_by_class
import helpers.train
from helpers.hf import hf_moe, needs_transformers, transformers
from helpers.launch import torchrun_train
from helpers.paths import REPO

ROOT = REPO
SWINV2_MOE = ROOT / "configs" / "experiments" / "swinv2_moe.yaml"
needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                   reason="scikit-learn is not installed (pip install -e .[images])")
pytestmark = [needs_transformers, needs_sklearn, pytest.mark.timeout(300)]

# 16x16 images, 2x2 patches: 64, 16, 4 and 1 tokens per image in the 4 stages of 2 blocks (sites 0-7);
# MoE in blocks 5 (stage 3) and 7 (stage 4)
TINY = ["data.image_size=16", "data.augment=false", "hf.patch_size=2", "hf.embed_dim=16", "hf.depths=[2,2,2,2]",
        "hf.num_heads=[1,2,2,4]", "hf.drop_path_rate=0.0", "upcycle.layers=[4,5,6,7]", "moe.num_experts=4",
        "train.batch_size=16", "train.eval_batches=4", "train.warmup_steps=5", "train.lr=0.001", "log.progress=false"]
TOKENS_PER_IMAGE = [4, 1]   # in MoE layers 1 and 2


def run(tmp_path, *overrides, name="run"):
    return helpers.train.run(tmp_path, *TINY, *overrides, name=name, config=SWINV2_MOE)


def test_digits_split_by_class_and_resume_exactly(tmp_path, fresh_seed):
    _, y_N = load_digits()
    train_N, val_N = split_by_class(y_N, 0.2, fresh_seed)
    assert sorted(torch.cat([train_N, val_N]).tolist()) == list(range(len(y_N)))
    for label in range(NUM_CLASSES):
        assert int((y_N[val_N] == label).sum()) == round(0.2 * int((y_N == label).sum()))
    cfg = DataConfig(task="image", image_size=12, val_fraction=0.2, seed=fresh_seed)
    data = make_data(cfg, batch_size=100, seq_len=0, val_batches=2)
    x, y = data.train.next()
    assert x.shape == (100, 1, 12, 12) and y.shape == (100,) and len(data.val) == 2
    data.train.next()   # a batch straddling the epoch is not needed here; the order tensor carries across
    torch.save(data.train.state_dict(), tmp_path / "state.pt")
    expected = [data.train.next() for _ in range(20)]          # 20 x 100 > one epoch of 1,438
    again = make_data(cfg, batch_size=100, seq_len=0, val_batches=2)
    again.train.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for (x, y), (x2, y2) in zip(expected, (again.train.next() for _ in range(20))):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    plain = make_data(DataConfig(task="image", image_size=12, val_fraction=0.2, seed=fresh_seed, augment=False),
                      batch_size=100, seq_len=0, val_batches=2)
    x_plain, y_plain = plain.train.next()
    assert torch.equal(y_plain, make_data(cfg, 100, 0, 2).train.next()[1])   # same order, augmented or not
    assert not torch.allclose(x_plain, make_data(cfg, 100, 0, 2).train.next()[0], atol=0.1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(plain.val, data.val))   # validation is never augmented
    rank0, rank1 = (make_data(cfg, 8, 0, 1, rank=r, world_size=2) for r in (0, 1))
    assert len(rank0.train.y_N) + len(rank1.train.y_N) == len(train_N)


def test_swinv2_moe_learns_and_writes_the_usual_outputs(tmp_path, fresh_seed):
    result, records = run(tmp_path, "train.steps=40", "train.eval_every=20", "log.every=5",
                          "train.checkpoint_every=20", f"train.seed={fresh_seed}", f"data.seed={fresh_seed}")
    out = tmp_path / "run"
    for name in ("metrics.jsonl", "loss.png", "accuracy.png", "expert_load.png", "summary.txt", "result.json",
                 "config.yaml", "checkpoints/step_000020", "checkpoints/step_000040"):
        assert (out / name).exists(), name
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert result["val_loss_last"] < result["val_loss_first"] - 0.3
    assert result["val_accuracy_last"] > result["val_accuracy_first"] + 0.2 and result["images"] == 40 * 16
    last = records[-1]
    assert set(last) >= {"loss", "accuracy", "images_per_s", "dropped_fraction", "tokens_per_expert", "val_accuracy"}
    assert "tokens_per_s" not in last and 0 <= last["accuracy"] <= 1
    for load, tokens in zip(last["tokens_per_expert"], TOKENS_PER_IMAGE, strict=True):
        assert len(load) == 4 and sum(load) == 5 * 16 * tokens   # 5 steps of 16 images, top-1
    summary = (out / "summary.txt").read_text()
    assert "640 images" in summary and "validation accuracy" in summary and "digit 9" in summary
    state = checkpoint.nest(checkpoint.full_state(out / "checkpoints" / "step_000040"))["model"]
    assert state["hf.swinv2.encoder.layers.2.blocks.1.intermediate.moe.experts.w1_EDH"].shape == (4, 64, 256)
    # the checkpoint's model gives the run's last validation loss and accuracy
    from moe_plugin.train.hf_image import build_image_model
    cfg = train.load_config(str(SWINV2_MOE), [*TINY, f"data.seed={fresh_seed}"])
    model = build_image_model(cfg)
    model.load_state_dict(state)
    data = make_data(cfg.data, cfg.train.batch_size, 0, cfg.train.eval_batches)
    loss, accuracy = train.loop.evaluate_images(model, data.val, torch.device("cpu"))
    assert loss == pytest.approx(result["val_loss_last"], rel=1e-5) and accuracy == result["val_accuracy_last"]
    # hf_model/: the dense folder plus the experts, which load_upcycled turns back into the trained model
    from moe_plugin.integrations.transformers.upcycle_export import load_upcycled
    loaded = load_upcycled(out / "hf_model").eval()
    model.eval()
    x = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        assert torch.allclose(loaded(pixel_values=x).logits, model(x), rtol=1e-5, atol=1e-5)
    assert "hf_model/ (upcycle_export.load_upcycled loads it)" in summary
    # over the whole validation split (its last batch smaller): the mean over images, against plain per-image losses
    whole = make_data(cfg.data, cfg.train.batch_size, 0, 100).val
    assert len(whole[-1][1]) < cfg.train.batch_size and sum(len(y) for _, y in whole) == 359
    loss, accuracy = train.loop.evaluate_images(model, whole, torch.device("cpu"))
    model.eval()
    with torch.no_grad():   # batch by batch: an MoE layer's capacity depends on the batch
        logits = [model(x) for x, _ in whole]
    y = torch.cat([y for _, y in whole])
    assert loss == pytest.approx(F.cross_entropy(torch.cat(logits), y).item(), rel=1e-5)
    assert accuracy == pytest.approx((torch.cat(logits).argmax(-1) == y).double().mean().item(), abs=1e-12)


def test_the_model_is_swinv2_upcycled_as_swinv2_moe(fresh_seed):
    """The trainer's model is transformers' Swinv2ForImageClassification with MoE blocks in blocks 5 and 7,
    configured by the moe section, exactly what upcycle() gives on the dense model of the same seed."""
    from moe_plugin.train.hf_image import build_image_model, image_hf_config
    cfg = train.load_config(str(SWINV2_MOE), TINY)
    torch.manual_seed(fresh_seed)
    model = build_image_model(cfg)
    torch.manual_seed(fresh_seed)
    by_hand = transformers.AutoModelForImageClassification.from_config(image_hf_config(cfg))
    hf_moe.upcycle(by_hand, num_experts=4, top_k=1, every=2, layers=[4, 5, 6, 7], reinit_fraction=1.0,
                   block_class=hf_moe.HFMoEBlock, router="cosine", capacity_factor=1.25, eval_capacity_factor=2.0,
                   batch_prioritized_routing=True, aux_loss="gshard", aux_loss_coef=0.01)
    assert type(model.hf) is transformers.Swinv2ForImageClassification
    assert model.hf.config.num_channels == 1 and model.hf.config.num_labels == 10 and model.hf.config.image_size == 16
    layers = model.moe_layers()
    assert [m.config.model_dim for m in layers] == [64, 128]
    for layer in layers:
        c = layer.config
        assert (c.num_experts, c.top_k, c.router, c.capacity_factor, c.batch_prioritized_routing, c.activation) == \
            (4, 1, "cosine", 1.25, True, "gelu")
    stages = model.hf.swinv2.encoder.layers
    assert [isinstance(stages[s].blocks[b].intermediate.moe, MoELayer) for s, b in ((2, 1), (3, 1))] == [True, True]
    assert not any(isinstance(m, MoELayer) for s in (0, 1) for m in stages[s].modules())
    assert not any(isinstance(m, MoELayer) for m in stages[2].blocks[0].modules())
    x = torch.randn(5, 1, 16, 16)
    model.eval(), by_hand.eval()
    with torch.no_grad():
        assert torch.equal(model(x), by_hand(pixel_values=x).logits)


def test_the_shipped_yaml_puts_moe_in_blocks_5_7_and_9():
    """configs/experiments/swinv2_moe.yaml as it ships (no override): MoE blocks exactly in blocks 5 and 7
    (stage 3, its 2nd and 4th blocks) and 9 (stage 4, its 2nd), as docs/training.md says, with the moe section's
    settings; planned by upcycle.plan on a meta-device model (no weights)."""
    from moe_plugin.integrations.transformers.upcycle import plan
    from moe_plugin.train.hf_image import image_hf_config, upcycle_arguments
    cfg = train.load_config(str(SWINV2_MOE), [])
    arguments = upcycle_arguments(cfg)
    assert (arguments.pop("noise"), arguments.pop("reinit_fraction")) == (0.0, 1.0)
    with torch.device("meta"):
        dense = transformers.AutoModelForImageClassification.from_config(image_hf_config(cfg))
    planned = plan(dense, **arguments)
    assert [index for index, *_ in planned] == [5, 7, 9]
    assert [name for _, name, *_ in planned] == [f"swinv2.encoder.layers.{s}.blocks.{b}" for s, b in
                                                 ((2, 1), (2, 3), (3, 1))]
    assert all(kind == "pair" for _, _, kind, _, _ in planned)
    configs = [config for *_, config in planned]
    assert [(c.model_dim, c.hidden_size) for c in configs] == [(128, 512), (128, 512), (256, 1024)]
    for c in configs:
        assert (c.num_experts, c.top_k, c.router, c.capacity_factor, c.eval_capacity_factor,
                c.batch_prioritized_routing, c.aux_loss, c.aux_loss_coef, c.activation, c.ep_size) == \
            (8, 1, "cosine", 1.25, 2.0, True, "gshard", 0.01, "gelu", 1)

def test_dense_swinv2_is_the_same_command_with_upcycle_null_and_upcycles(tmp_path, fresh_seed):
    result, records = run(tmp_path, "upcycle=null", "train.steps=40", "train.eval_every=40", "log.every=10",
                          f"train.seed={fresh_seed}", f"data.seed={fresh_seed}")
    out = tmp_path / "run"
    assert all(r["tokens_per_expert"] == [] and r["dropped_fraction"] == 0 for r in records if "loss" in r)
    assert (out / "loss.png").exists() and (out / "accuracy.png").exists() and not (out / "expert_load.png").exists()
    assert result["val_loss_last"] < result["val_loss_first"] - 0.3
    state = checkpoint.nest(checkpoint.full_state(out / "checkpoints" / "step_000040"))["model"]
    assert "hf.swinv2.encoder.layers.3.blocks.1.intermediate.dense.weight" in state
    assert not any("moe" in key for key in state)
    assert "expert_load.png" not in (out / "summary.txt").read_text()
    from moe_plugin.train.hf_image import build_image_model
    model = build_image_model(train.load_config(str(SWINV2_MOE), [*TINY, "upcycle=null"])).eval()
    model.load_state_dict(state)
    plain = transformers.AutoModelForImageClassification.from_pretrained(out / "hf_model").eval()
    x = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        assert torch.allclose(plain(pixel_values=x).logits, model(x), rtol=1e-5, atol=1e-5)
    # sparse upcycling of this dense run: exact copies, no drops, normalized top-1 gates (= 1) start where it ended
    _, upcycled = run(tmp_path, f"upcycle.checkpoint={out}", "upcycle.reinit_fraction=0.0", "moe.capacity_factor=0",
                      "moe.eval_capacity_factor=0", "moe.normalize_gate=before_drop", "train.steps=2", "log.every=1",
                      "log.plots=false", f"train.seed={fresh_seed + 1}", f"data.seed={fresh_seed}", name="upcycled")
    assert upcycled[0]["val_loss"] == pytest.approx(result["val_loss_last"], rel=1e-5)
    assert upcycled[0]["val_accuracy"] == result["val_accuracy_last"] and len(upcycled[1]["tokens_per_expert"]) == 2


def test_resume_continues_bit_exactly(tmp_path, fresh_seed):
    common = ["train.steps=8", "train.eval_every=4", "train.checkpoint_every=4", "log.every=1", "log.plots=false",
              f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    full, full_records = run(tmp_path, *common, name="full")
    run(tmp_path, *common, "train.stop_at=4", name="split")
    resumed, split_records = run(tmp_path, *common, "train.resume=latest", name="split")
    for key in ("loss", "accuracy", "aux_loss", "val_loss", "val_accuracy", "dropped_fraction", "tokens_per_expert"):
        assert [r.get(key) for r in split_records] == [r.get(key) for r in full_records], key
    assert resumed["param_sha256_per_rank"] == full["param_sha256_per_rank"]


@pytest.mark.parametrize("override, expected", [
    ("data.task=images", r"data.task='images' is invalid: must be one of 'lm', 'image'"),
    ("data.dataset=mnist", r"data.dataset='mnist' is invalid: must be one of 'digits'"),
    ("data.image_size=4", r"data.image_size=4 is invalid: must be >= 8"),
    ("data.path=/etc/hostname", r"data.path='/etc/hostname' is invalid with data.task='image'"),
    ("hf.model_type=llama", r"hf.model_type='llama' is invalid with data.task='image': must be one of swinv2"),
    ("hf.num_channels=3", r"hf.num_channels=3 is invalid: data.dataset='digits' gives 1"),
    ("hf.image_size=32", r"hf.image_size=32 is invalid: data.image_size gives 16"),
    ("hf.embed_dm=8", r"hf.embed_dm is not a field of Swinv2Config; valid keys: .*embed_dim"),
    ("hf.num_heads=[1,1,2]", r"hf.num_heads=\[1, 1, 2\] is invalid: must have one entry per stage"),
    ("hf.num_heads=[1,2,3,4]", r"hf.num_heads=\[1, 2, 3, 4\] is invalid: stage 3 is 64 wide"),
    ("upcycle.evry=2", r"unknown key 'upcycle.evry' \(did you mean 'every'\?\); valid keys of section upcycle: every"),
    ("upcycle.layers=[4,8]", r"upcycle section: upcycle: layers=\[4, 8\] has \[8\] out of range"),
    ("upcycle.every=0", r"every=0 is invalid"),
    ("moe.hidden_size=64", r"moe.hidden_size=64 is invalid with upcycle: the dense MLPs of the hf model fix it"),
    ("moe.top_k=5", r"moe section: MoEConfig.top_k=5 is invalid"),
    ("moe.router=cosin", r"moe section: MoEConfig.router='cosin' is invalid"),
    ("parallel.ep_size=3", r"parallel.ep_size=3 is invalid"),
    ("parallel.fsdp=true", r"parallel.fsdp=true is invalid with data.task='image'"),
    ("hf=null", r"data.task='image' needs an hf section"),
])
def test_bad_image_configs_name_the_key(override, expected):
    with pytest.raises(ValueError, match=expected):
        train.load_config(str(SWINV2_MOE), [*TINY, override])


@pytest.mark.parametrize("override, expected", [
    ("data.image_size=16", r"data.image_size=16 is invalid with data.task='lm': it applies to data.task='image'"),
    ("upcycle.every=2", r"upcycle is invalid (with data.task='lm'|without an hf section)"),
    ("hf.model_type=swinv2", r"hf.model_type='swinv2' is an image classifier: it needs data.task='image'"),
])
def test_image_keys_are_errors_for_a_language_model(override, expected):
    with pytest.raises(ValueError, match=expected):
        train.load_config(None, [override])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_expert_parallel(tmp_path, fresh_seed):
    out = tmp_path / "ep"
    result, records = torchrun_train(out, str(SWINV2_MOE), *TINY, "parallel.ep_size=2", "train.steps=6",
                                     "train.eval_every=6", "log.every=3", "log.plots=false",
                                     f"train.seed={fresh_seed}", timeout=240)
    shared, everything = result["shared_param_sha256_per_rank"], result["param_sha256_per_rank"]
    assert shared[0] == shared[1] and everything[0] != everything[1]   # each rank holds its own experts
    for load, tokens in zip(records[-1]["tokens_per_expert"], TOKENS_PER_IMAGE, strict=True):
        assert sum(load) == 3 * 2 * 16 * tokens   # both processes' images
    # the checkpoint holds every expert: one process loads it and gets the run's last validation loss
    state = checkpoint.nest(checkpoint.full_state(out / "checkpoints" / "step_000006"))["model"]
    assert state["hf.swinv2.encoder.layers.2.blocks.1.intermediate.moe.experts.w1_EDH"].shape[0] == 4
    from moe_plugin.train.hf_image import build_image_model
    cfg = train.load_config(str(SWINV2_MOE), TINY)
    model = build_image_model(cfg)
    model.load_state_dict(state)
    data = make_data(cfg.data, cfg.train.batch_size, 0, cfg.train.eval_batches)
    loss, _ = train.loop.evaluate_images(model, data.val, torch.device("cpu"))
    assert loss == pytest.approx(result["val_loss_last"], rel=1e-5)


def test_print_config_shows_the_image_experiment(capsys):
    from moe_plugin.cli import main
    assert main(["train", str(SWINV2_MOE), *TINY, "--print-config"]) == 0
    printed = capsys.readouterr().out
    for line in ("  task: image", "  model_type: swinv2", "  router: cosine", "  batch_prioritized_routing: true",
                 "  reinit_fraction: 1.0"):
        assert line in printed.splitlines(), line
    assert main(["train", str(SWINV2_MOE), *TINY, "upcycle=null", "--print-config"]) == 0
    assert "upcycle: null" in capsys.readouterr().out.splitlines()
