"""Replicas of hot experts (MoEConfig.redundant_experts, issue 55 item 2) on 2 and 4 gloo processes against the same
layer with redundant_experts=0: a router skewed towards rank 0's experts so that copies are made, k up to 3, dropped
tokens, an expert without tokens, a rank without tokens, odd token counts, overlap chunks, 2DH; outputs, the input's,
the router's and every expert weight's gradient equal (fp64 1e-12, fp32 1e-5); the state dict holds no copy and
loads both ways. "auto" is the tuner's choice of R per load: over its steps it times several counts, every step
equal to redundant_experts=0. Then single-process checks of the plan, the split and the config's refusals."""
import io

import pytest
import torch
import torch.distributed as dist

from helpers.compare import relative_error
from helpers.launch import run_workers
from moe_plugin import MoEConfig, MoELayer
from moe_plugin.parallel.replicas import level, split_rows
from moe_plugin.routing_monitor import RoutingMonitor

D, H = 6, 10

SPECS = {
    2: [dict(name="k3_dropless", E=8, k=3, cf=0.0, R=3, tokens=[23, 0], hot=[0, 1, 2]),
        dict(name="drops_empty_expert_overlap", E=4, k=2, cf=1.0, R=2, d=2, tokens=[17, 30], hot=[0], cold=3,
             activation="swiglu", bias=False),
        dict(name="fp32", E=6, k=2, cf=0.0, R=2, tokens=[40, 29], hot=[0, 1], dtype=torch.float32),
        dict(name="gate_on_input_shared", E=4, k=2, cf=0.0, R=1, tokens=[21, 13], hot=[0],
             extra=dict(gate_on_input=True, shared_hidden_size=4, recompute="experts"))],
    4: [dict(name="skew_top2", E=16, k=2, cf=0.0, R=4, tokens=[31, 0, 19, 26], hot=[0, 1, 2, 3]),
        dict(name="k4_drops_2dh", E=8, k=4, cf=1.25, R=5, tokens=[9, 25, 14, 33], hot=[0, 1], cold=7, a2a="2dh",
             node=2, d=2),
        dict(name="fp32_tuner", E=4, k=1, cf=0.0, R=3, tokens=[35, 21, 0, 12], hot=[0], parallel="auto",
             dtype=torch.float32),
        # "auto": the tuner times the replica counts worth trying (the most first), every step compared
        dict(name="auto", E=8, k=2, cf=0.0, R="auto", tokens=[400, 380, 410, 390], hot=[0, 1], D=128, H=256,
             steps=6),
        dict(name="auto_sliced", E=2, k=1, cf=0.0, R="auto", tokens=[12, 7, 9, 3], hot=[0], copies=False)],
}


def build(spec, world, redundant):
    config = MoEConfig(model_dim=spec.get("D", D), hidden_size=spec.get("H", H), num_experts=spec["E"], top_k=spec["k"],
                       capacity_factor=spec["cf"], min_capacity=0, activation=spec.get("activation", "relu"),
                       bias=spec.get("bias", True), router_bias=True, z_loss_coef=0.01, ep_size=world,
                       parallel=spec.get("parallel", 1), overlap_degree=spec.get("d", 1), a2a=spec.get("a2a", "flat"),
                       node_size=spec.get("node"), redundant_experts=redundant, **spec.get("extra", {}))
    return MoELayer(config).to(spec.get("dtype", torch.float64))


def weights(layer):
    """The state dict without the tuner's dictionary ("auto" tunes R; it holds no weight)."""
    return {k: v for k, v in layer.state_dict().items() if k != "tuner._extra_state"}


def compare_with_no_replicas(rank, world, specs):
    out = {}
    for i, spec in enumerate(specs):
        dtype = spec.get("dtype", torch.float64)
        torch.manual_seed(100 + i)
        reference = build(spec, world, 0)
        with torch.no_grad():
            reference.router.bias_E.zero_()
            reference.router.bias_E[spec["hot"]] = 3.0       # rank 0 holds the hot experts
            if "cold" in spec:
                reference.router.bias_E[spec["cold"]] = -1e4     # an expert without tokens
        layer = build(spec, world, spec["R"])
        layer.load_state_dict(reference.state_dict())        # the same layout: no copy in either
        generator = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(spec["tokens"][rank], spec.get("D", D), generator=generator, dtype=torch.float64).to(dtype)
        up = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(dtype)
        got, rows_W, copies, used = {}, torch.zeros(world, dtype=torch.float64), [], []
        monitor = RoutingMonitor(torch.nn.ModuleDict({"reference": reference, "replicas": layer}))
        steps = spec.get("steps", 2)     # the second step re-plans from its own counts
        for name, model in (("reference", reference), ("replicas", layer)):
            model.train()
            for step in range(steps):
                model.zero_grad()
                x_in = x.clone().requires_grad_()
                y = model(x_in)
                ((y * up).sum() + model.aux_loss).backward()
                if model is layer and "rank_rows" in layer.stats:
                    rows_W += torch.tensor(layer.stats["rank_rows"], dtype=torch.float64)
                    copies += layer.stats["replicas"]
                    used.append(layer.stats["redundant_experts"])
                got[name, step] = {"y": y.detach(), "x.grad": x_in.grad, "aux": model.aux_loss.detach(),
                                   **{n: p.grad for n, p in model.named_parameters()}}
        errors = {key: max(relative_error(got["replicas", step][key], got["reference", step][key], floor=1e-12)
                           for step in range(steps)) for key in got["reference", 0]}
        stats = layer.stats
        metrics = monitor.read()
        dist.all_reduce(rows_W)
        saved = io.BytesIO()
        torch.save(layer.state_dict(), saved)
        saved.seek(0)
        state = torch.load(saved)
        fresh = build(spec, world, 0)
        fresh.load_state_dict(state)                          # replicas -> none
        back = build(spec, world, spec["R"])
        back.load_state_dict(fresh.state_dict())              # and back
        out[spec["name"]] = dict(errors=errors, copies=copies or stats.get("replicas"), used=used,
                                 tuned=stats.get("tuned"), rank_rows=stats.get("rank_rows"),
                                 max_rank_load={k: v["max_rank_load"] for k, v in metrics.items()},
                                 counted=float(rows_W.max() / rows_W.mean()),
                                 keys=(sorted(weights(layer)) == sorted(weights(reference))),
                                 same=all(torch.equal(a, b) for a, b in zip(weights(back).values(),
                                                                            weights(reference).values())))
    if world == 2:      # LoRA adapters are not carried: refused at the forward
        from moe_plugin.lora import add_lora
        layer = build(SPECS[2][0], world, 1)
        add_lora(layer, 2)
        try:
            layer(torch.randn(5, D, dtype=torch.float64))
        except ValueError as error:
            out["lora"] = str(error)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_replicas_change_no_number(world):
    results = run_workers(compare_with_no_replicas, world, SPECS[world], timeout=400)
    for spec in SPECS[world]:
        tol = 1e-5 if spec.get("dtype") == torch.float32 else 1e-12
        for rank, result in enumerate(results):
            got = result[spec["name"]]
            worst = {k: v for k, v in got["errors"].items() if not v <= tol}
            assert not worst, (spec["name"], rank, worst)
            assert got["keys"] and got["same"], (spec["name"], rank)
            assert got["copies"] == results[0][spec["name"]]["copies"], "every rank plans alike"
        copies = results[0][spec["name"]]["copies"]
        if spec.get("copies") is False:      # "auto" makes none where they cannot work (sliced experts)
            assert copies is None and results[0][spec["name"]]["max_rank_load"]["replicas"] == \
                results[0][spec["name"]]["max_rank_load"]["reference"]
            continue
        assert copies and all(e in spec["hot"] for e, _ in copies), (spec["name"], copies)   # copies were used
        rows = torch.tensor([r[spec["name"]]["rank_rows"] for r in results]).sum(0)
        assert rows.sum() > 0
        read = results[0][spec["name"]]["max_rank_load"]
        if spec["cf"] == 0:     # dropless: the monitor's busiest rank is the one counted from the split
            assert read["replicas"] == pytest.approx(results[0][spec["name"]]["counted"], rel=1e-12)
        assert read["replicas"] < read["reference"], (spec["name"], read)
        if spec["R"] == "auto":      # the tuner's R: the most copies first, then fewer, alike on every rank
            used = results[0][spec["name"]]["used"]
            assert used[0] > 0 and used[-1] < used[0], used
            assert all(result[spec["name"]]["used"] == used for result in results)
    if world == 2:
        assert "redundant_experts=1 does not carry LoRA adapters" in results[0]["lora"]


def test_level_and_split():
    assert level([0, 15], 23) == [19, 4] and level([5, 5, 5], 7) == [3, 2, 2] and level([10, 0], 3) == [0, 3]
    share_E = torch.tensor([.23, .14, .13, .05] + [.45 / 12] * 12)
    counts_WE = torch.stack([(share_E * 4096).round().long() + w for w in range(4)])   # rank 0 holds experts 0-3
    owner_rows = counts_WE.sum(0).view(4, 4).sum(1)
    assert float(owner_rows.max() / owner_rows.float().mean()) > 2.1
    split = split_rows(counts_WE, 4, 4)
    assert len(split.copies) <= 4 and all(e < 4 and h != 0 for e, h in split.copies)
    rows_W = sum(split.rank_rows(w) for w in range(4))
    assert float(rows_W.max() / rows_W.float().mean()) < 1.05
    assert torch.equal(split.counts_WJ.sum(1), counts_WE.sum(1))          # every row goes once
    per_expert = torch.zeros(4, 16, dtype=torch.long).index_add_(1, split.slot_expert_J, split.counts_WJ)
    assert torch.equal(per_expert, counts_WE)
    flat = split_rows(torch.full((4, 16), 50), 4, 4)
    assert flat.copies == []                                            # a flat load gets no copy


def test_auto_copies_what_pays():
    from moe_plugin.experts import ExpertWeights
    from moe_plugin.parallel.replicas import worth_copying
    weights = ExpertWeights(torch.zeros(4, 256, 512), torch.zeros(4, 512), torch.zeros(4, 512, 256), torch.zeros(4, 256))
    most, copy_rows = worth_copying("auto", weights, torch.zeros(1, 256), 4, 4)
    # GLOO_HERE: a row's expert compute 6 * 256 * 512 * 2 flops at 0.028 TFLOP/s and its four passes of 256 floats
    # at 0.4 GB/s; a copy 2 x (1.75 ms + 1.05 MB at 0.4 GB/s)
    row = 6 * 256 * 512 * 2 / 0.028e12 + 4 * 256 * 4 / 0.4e9
    copy = 2 * (1.75e-3 + 4 * (2 * 256 * 512 + 512 + 256) / 0.4e9)
    assert most == float("inf") and copy_rows == pytest.approx(copy / row)
    assert worth_copying(3, weights, torch.zeros(1, 256), 4, 4) == (3, 0.0)
    share_E = torch.tensor([.23, .14, .13, .05] + [.45 / 12] * 12)
    skewed = torch.stack([(share_E * 4096).round().long()] * 4)
    assert len(split_rows(skewed, 4, most, copy_rows).copies) >= 3
    flat = torch.stack([torch.full((16,), 256) + torch.randint(-8, 8, (16,)) for _ in range(4)])
    assert split_rows(flat, 4, most, copy_rows).copies == []     # the copies would cost more than they save


@pytest.mark.parametrize("changes, message", [
    (dict(redundant_experts=-1), "redundant_experts=-1 is invalid: must be an integer >= 0 or \"auto\""),
    (dict(redundant_experts="all"), "redundant_experts='all' is invalid"),
    (dict(redundant_experts=2.5), "redundant_experts=2.5 is invalid"),
    (dict(redundant_experts=2, ep_size=8), "num_experts=4 < ep_size=8"),
    (dict(redundant_experts=2, ep_size=2, parallel=0), "parallel=0"),
])
def test_the_config_refuses(changes, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(model_dim=4, hidden_size=8, num_experts=4, **changes)
    assert MoEConfig(model_dim=4, hidden_size=8, num_experts=4, redundant_experts="auto").redundant_experts == "auto"


def test_expert_modules_are_refused():
    with pytest.raises(ValueError, match="redundant_experts=1 is invalid with expert=<a module>"):
        MoELayer(MoEConfig(model_dim=4, hidden_size=8, num_experts=4, ep_size=2, redundant_experts=1),
                 expert=torch.nn.Linear(4, 4))


def test_one_process_has_nothing_to_copy(monkeypatch):
    """At ep_size 1 every expert is here: redundant_experts does nothing (a config rebuilt at ep_size 1 works), and
    a training forward says so once per process ("auto", 0 and evaluation say nothing)."""
    import warnings
    from moe_plugin import layer as layer_module
    monkeypatch.setattr(layer_module, "_IDLE_COPIES_WARNED", [])
    torch.manual_seed(0)
    reference = MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=4, capacity_factor=0.0))
    layer = MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=4, capacity_factor=0.0, redundant_experts=3))
    auto = MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=4, capacity_factor=0.0,
                              redundant_experts="auto"))
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(9, D)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reference(x), auto(x), layer.eval()(x)
    with pytest.warns(UserWarning, match="redundant_experts=3 does nothing at ep_size 1: every process holds"):
        y = layer.train()(x)
    assert torch.equal(y, reference(x)) and "replicas" not in layer.stats
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x)


def test_every_host_key_reaches_the_layer():
    from moe_plugin.train.config import moe_config, parse_config
    assert moe_config(parse_config(None, ["moe.redundant_experts=2", "parallel.ep_size=2"])).redundant_experts == 2
    with pytest.raises(ValueError, match="redundant_experts=-2 is invalid"):
        moe_config(parse_config(None, ["moe.redundant_experts=-2"]))

    from moe_plugin.integrations.deepspeed.native import MoE
    from moe_plugin.integrations.deepspeed.native import moe_config as deepspeed_config
    from moe_plugin.integrations.deepspeed.section import read_moe_section
    assert read_moe_section({"moe": {"backend": "tutel", "redundant_experts": 3}})["redundant_experts"] == 3
    assert read_moe_section({"moe": {"backend": "tutel", "redundant_experts": "auto"}})["redundant_experts"] == "auto"
    with pytest.raises(ValueError, match='"moe.redundant_experts"=-1 is invalid'):
        read_moe_section({"moe": {"backend": "tutel", "redundant_experts": -1}})
    with pytest.raises(ValueError, match='"moe.redundant_experts"=2 needs "moe.backend": "tutel"'):
        read_moe_section({"moe": {"backend": "deepspeed", "redundant_experts": 2}})
    config = deepspeed_config(D, H, 4, 2, 2, 1.0, 1.0, 4, False, "relu", True, redundant_experts=3)
    assert config.redundant_experts == 3 and config.ep_size == 2
    expert = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, D))
    layer = MoE(D, expert, num_experts=4, k=2, use_rts=False, top2_2nd_expert_sampling=False, redundant_experts=2)
    assert layer.deepspeed_moe.config.redundant_experts == 2


def test_the_fairseq_flag_reaches_the_layer():
    pytest.importorskip("fairseq")
    import argparse

    from moe_plugin.integrations.fairseq_moe.config import add_moe_args, moe_config_from_args, set_moe_defaults
    parser = argparse.ArgumentParser()
    add_moe_args(parser)
    for flags, count in (([], 0), (["--moe-redundant-experts", "3", "--moe-ep-size", "2"], 3),
                         (["--moe-redundant-experts", "auto"], "auto")):
        args = parser.parse_args(flags)
        set_moe_defaults(args)
        args.activation_fn = "relu"
        assert moe_config_from_args(args, D, H).redundant_experts == count


def test_the_hf_swap_keyword_reaches_the_layer():
    pytest.importorskip("transformers")
    from helpers.hf import build_model
    from moe_plugin.integrations.transformers import swap_moe_blocks
    model = swap_moe_blocks(build_model("mixtral", seed=0), redundant_experts=2)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert layers and all(m.config.redundant_experts == 2 for m in layers)
