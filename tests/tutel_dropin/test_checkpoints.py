"""Tutel and Swin-MoE checkpoints at any number of ranks (moe_plugin/tutel/checkpoints.py, `moe-plugin checkpoint
convert --from tutel`).

The files are generated here from a reference model (random values, several MoE layers and non-expert tensors),
each rank's file cut by this file's own slicing, written from Tutel's documented layouts (doc/CHECKPOINT.md, its
experts' parameter shapes, Swin-MoE's split into rank files and a master file); every conversion must give back the
reference's tensors bit for bit.

Shape legend: moe_plugin/__init__.py (E experts, D model dim, H hidden dim per expert), S the ranks one expert is
sliced over.
"""
import math

import pytest
import torch
from torch import nn

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.cli import main as cli_main
from moe_plugin.train import load_full_state_dict
from moe_plugin.tutel import checkpoints, names

from helpers.compare import relative_error
from helpers.expert_parallel import D as EP_D, H as EP_H, expected_shard, single_process_grads
from helpers.launch import run_workers


PREFIXES = ("layers.1.blocks.1.mlp._moe_layer.", "layers.2.blocks.1.mlp._moe_layer.",
            "layers.2.blocks.3.mlp._moe_layer.")


def reference_model(E: int, D: int, H: int, dtype=torch.float32, prefixes=PREFIXES) -> dict:
    """A Swin-MoE-like model, all experts in one process: {key: tensor} in Tutel's all-in-one layout."""
    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64).to(dtype)
    model = {"patch_embed.proj.weight": rand(D, 3, 4, 4), "patch_embed.norm.weight": rand(D),
             "head.weight": rand(5, D), "head.bias": rand(5)}
    for p in prefixes:
        block = p[:-len("mlp._moe_layer.")]
        model.update({block + "attn.qkv.weight": rand(3 * D, D), block + "norm2.weight": rand(D),
                      p + "gates.0.wg.weight": rand(E, D), p + "experts.batched_fc1_w": rand(E, H, D),
                      p + "experts.batched_fc2_w": rand(E, H, D), p + "experts.batched_fc1_bias": rand(E, H),
                      p + "experts.batched_fc2_bias": rand(E, D)})
    return model


def is_expert(key: str) -> bool:
    return ".experts." in key or key.startswith("experts.")


def swin_rank_files(model: dict, E: int, folder, name="swin_moe.pth") -> list:
    """Swin-MoE's published layout: rank r's file {"model": its experts only}, as [1, H, D] weights and [1, 1, H]
    biases, no _num_global_experts; NAME.master {"model": every other tensor}."""
    paths = []
    for r in range(E):
        experts = {k: (v[r:r + 1].clone() if v.dim() == 3 else v[r].reshape(1, 1, -1).clone())
                   for k, v in model.items() if is_expert(k)}
        paths.append(folder / f"{name}.rank{r}")
        torch.save({"model": experts}, paths[-1])
    torch.save({"model": {k: v for k, v in model.items() if not is_expert(k)}}, folder / f"{name}.master")
    return paths + [folder / f"{name}.master"]


def expected_rank(model: dict, E: int, W: int, r: int, pad=None) -> dict:
    """Rank r of W's state dict as Tutel's moe_layer holds it: E / W whole experts, or slice r % S of expert r // S
    (S = W / E: the hidden rows of the weights and fc1's bias, fc2's bias padded to S * ceil(D / S))."""
    out = {}
    for key, value in model.items():
        if not is_expert(key):
            out[key] = value
        elif W <= E:
            out[key] = value[r * (E // W):(r + 1) * (E // W)]
        else:
            S = W // E
            e, s = r // S, r % S
            if key.endswith("batched_fc2_bias"):
                c = math.ceil(value.shape[1] / S)
                filler = value.new_zeros(S * c - value.shape[1]) if pad is None else pad(S * c - value.shape[1])
                out[key] = torch.cat([value[e], filler])[s * c:(s + 1) * c].reshape(1, c)
            else:
                h = value.shape[1] // S
                out[key] = value[e:e + 1, s * h:(s + 1) * h]
    for p in {k[:k.index("experts.")] for k in model if is_expert(k)}:
        out[p + "_num_global_experts"] = torch.tensor(E)
    return out


def assert_bit_equal(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key


def with_counts(model: dict, E: int) -> dict:
    return {**model, **{p + "_num_global_experts": torch.tensor(E)
                        for p in {k[:k.index("experts.")] for k in model if is_expert(k)}}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_swin_moe_32_ranks_to_2_to_1_to_8_bit_exact(tmp_path, dtype):
    E, D, H = 32, 6, 10
    model = reference_model(E, D, H, dtype)
    swin = swin_rank_files(model, E, tmp_path)
    read32 = checkpoints.read(swin)
    assert read32.ranks == 32 and read32.namespace == "model"
    assert read32.num_experts == {p: E for p in PREFIXES}
    assert_bit_equal(read32.state, with_counts(model, E))

    two = checkpoints.write(read32, str(tmp_path / "two" / "swin_moe.pth.rank{rank}"), 2)
    for r, path in enumerate(two):   # every file: its experts and the replicated tensors, under "model"
        assert_bit_equal(torch.load(path, weights_only=True)["model"], expected_rank(model, E, 2, r))
    read2 = checkpoints.read(two)
    one = checkpoints.write(read2, str(tmp_path / "one.pth"), 1)
    assert_bit_equal(torch.load(one[0], weights_only=True)["model"], with_counts(model, E))
    eight = checkpoints.write(checkpoints.read(one, namespace="model"), str(tmp_path / "8" / "{rank}-of-{size}.ckpt"), 8)
    assert [p.name for p in eight] == [f"{r}-of-8.ckpt" for r in range(8)]
    for r, path in enumerate(eight):
        assert_bit_equal(torch.load(path, weights_only=True)["model"], expected_rank(model, E, 8, r))
    assert_bit_equal(checkpoints.read(eight).state, with_counts(model, E))


def test_more_ranks_than_experts_slice_each_expert_and_pad_fc2_bias(tmp_path):
    """2 experts on 8 ranks (4 slices each: D 6 pads fc2's bias to 8, with garbage the reader must drop) -> one file
    -> 4 ranks (2 slices, no padding) -> 2 ranks (whole experts) -> 8 ranks again (zeros as the padding)."""
    E, D, H = 2, 6, 12
    model = reference_model(E, D, H, prefixes=PREFIXES[:2])
    paths = []
    for r in range(8):
        paths.append(tmp_path / f"{r}-of-8.ckpt")
        torch.save(expected_rank(model, E, 8, r, pad=lambda n: torch.randn(n)), paths[-1])
    full = checkpoints.read(paths)
    assert full.namespace == "" and full.num_experts == {p: 2 for p in PREFIXES[:2]}
    assert_bit_equal(full.state, with_counts(model, E))
    four = checkpoints.write(full, str(tmp_path / "4" / "{rank}-of-{size}.ckpt"), 4)
    for r, path in enumerate(four):
        assert_bit_equal(torch.load(path, weights_only=True), expected_rank(model, E, 4, r))
    two = checkpoints.write(checkpoints.read(four), str(tmp_path / "2" / "{rank}-of-{size}.ckpt"), 2)
    for r, path in enumerate(two):
        assert_bit_equal(torch.load(path, weights_only=True), expected_rank(model, E, 2, r))
    eight = checkpoints.write(checkpoints.read(two), str(tmp_path / "8" / "{rank}-of-{size}.ckpt"), 8)
    for r, path in enumerate(eight):   # written back with zeros as the padding
        assert_bit_equal(torch.load(path, weights_only=True), expected_rank(model, E, 8, r))


def tutel_files(model: dict, E: int, W: int, folder) -> list:
    """Tutel's own per-rank files (helloworld's torch.save(model.state_dict()) at {rank}-of-{size})."""
    paths = [folder / f"{r}-of-{W}.ckpt" for r in range(W)]
    for r, path in enumerate(paths):
        torch.save({k: v.clone() for k, v in expected_rank(model, E, W, r).items()}, path)
    return paths


def convert(*arguments) -> int:
    return cli_main(["checkpoint", "convert", *map(str, arguments)])


def test_the_command_converts_swin_moe_files_for_4_ranks(tmp_path, capsys):
    E = 32
    model = reference_model(E, 6, 10)
    swin = swin_rank_files(model, E, tmp_path)
    assert convert("--from", "tutel", *swin, tmp_path / "out" / "{rank}-of-{size}.ckpt", "--ranks", 4) == 0
    said = capsys.readouterr().out
    assert "read 3 MoE layers (32, 32, 32 experts) from a run of 32 ranks" in said and "0-of-4.ckpt" in said
    for r in range(4):
        got = torch.load(tmp_path / "out" / f"{r}-of-4.ckpt", weights_only=True)
        assert list(got) == ["model"]
        assert_bit_equal(got["model"], expected_rank(model, E, 4, r))


def test_an_existing_output_is_replaced_only_with_overwrite_and_a_source_never(tmp_path, capsys):
    """Nothing the user has is overwritten unasked: an existing output (a text file, another checkpoint) keeps its
    bytes without --overwrite; with it, the output is the conversion; a source file is refused even with it."""
    E = 4
    model = reference_model(E, 6, 10)
    sources = tutel_files(model, E, 2, tmp_path)
    before = {path: path.read_bytes() for path in sources}
    (tmp_path / "out").mkdir()
    notes, other = tmp_path / "out" / "0-of-2.ckpt", tmp_path / "out" / "1-of-2.ckpt"
    notes.write_text("my notes")
    torch.save({"model": {"w": torch.randn(3)}}, other)
    kept = {notes: notes.read_bytes(), other: other.read_bytes()}
    cases = [(["--from", "tutel", *sources, tmp_path / "out" / "{rank}-of-{size}.ckpt", "--ranks", 2], "exists"),
             (["--from", "tutel", *sources, notes, "--to", "moe_plugin"], "exists"),
             (["--from", "tutel", *sources, sources[0], "--to", "moe_plugin", "--overwrite"],
              "is one of the source files"),
             (["--from", "tutel", *sources, tmp_path / "{rank}-of-{size}.ckpt", "--ranks", 2, "--overwrite"],
              "is one of the source files")]
    for arguments, says in cases:
        capsys.readouterr()
        assert convert(*arguments) == 2, arguments
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (arguments, lines)
        assert {path: path.read_bytes() for path in [*sources, notes, other]} == {**before, **kept}
    assert convert("--from", "tutel", *sources, tmp_path / "out" / "{rank}-of-{size}.ckpt", "--ranks", 2,
                   "--overwrite") == 0
    for r in range(2):
        got = torch.load(tmp_path / "out" / f"{r}-of-2.ckpt", weights_only=True)
        assert_bit_equal(got, expected_rank(model, E, 2, r))


def test_to_moe_plugin_gives_moe_layer_state_dicts(tmp_path):
    """--to moe_plugin: one state dict, each Tutel layer in MoELayer's names (moe_plugin.tutel.names), every expert."""
    E, D, H = 4, 6, 10
    model = reference_model(E, D, H)
    assert convert("--from", "tutel", *tutel_files(model, E, 2, tmp_path), tmp_path / "moe.pt", "--to", "moe_plugin") == 0
    state = torch.load(tmp_path / "moe.pt", weights_only=True)
    for p in PREFIXES:
        layer = MoELayer(model_dim=D, hidden_size=H, num_experts=E, top_k=2, activation="relu", bias=True)
        layer.load_full_state_dict({k[len(p):]: v for k, v in state.items() if k.startswith(p)})
        assert torch.equal(layer.experts.w1_EDH, model[p + "experts.batched_fc1_w"].transpose(1, 2))
        assert torch.equal(layer.experts.w2_EHD, model[p + "experts.batched_fc2_w"])
        assert torch.equal(layer.experts.b1_EH, model[p + "experts.batched_fc1_bias"])
        assert torch.equal(layer.experts.b2_ED, model[p + "experts.batched_fc2_bias"])
        assert torch.equal(layer.router.weight_ED, model[p + "gates.0.wg.weight"])
    assert torch.equal(state["head.weight"], model["head.weight"])


def nudged(t: torch.Tensor) -> torch.Tensor:
    """t with one value moved by one ulp."""
    out = t.clone().view(-1)
    out[0] = torch.nextafter(out[0], torch.tensor(float("inf")))
    return out.view(t.shape)


@pytest.fixture
def four_ranks(tmp_path):
    model = reference_model(4, 6, 10)
    return model, tutel_files(model, 4, 4, tmp_path), tmp_path


def bad_inputs(model, paths, folder):
    """(arguments, what the error line must say)."""
    drifted = folder / "drift" / "2-of-4.ckpt"
    drifted.parent.mkdir()
    torch.save({**torch.load(paths[2], weights_only=True), "head.weight": nudged(model["head.weight"])}, drifted)
    other_run = folder / "1-of-8.ckpt"
    torch.save({}, other_run)
    (folder / "junk-0-of-1.ckpt").write_bytes(b"not a checkpoint")
    torch.save({"model": {}, "config": torch.nn.Identity()}, folder / "objects-0-of-1.ckpt")
    out = folder / "out" / "{rank}-of-{size}.ckpt"
    (folder / "swin").mkdir()
    swin = swin_rank_files(reference_model(32, 6, 10, prefixes=PREFIXES[:1]), 32, folder / "swin")
    return [
        (["--from", "tutel", paths[0], paths[1], drifted, paths[3], out, "--ranks", 2],
         f"the replicated tensor 'head.weight' differs between '{paths[0]}' and '{drifted}'"),
        (["--from", "tutel", paths[0], paths[1], paths[3], out, "--ranks", 2], "the files of ranks 2 are missing"),
        (["--from", "tutel", paths[0], other_run, out, "--ranks", 2], "the files come from runs of different sizes"),
        (["--from", "tutel", paths[0], paths[0], out, "--ranks", 2], "rank 0 is given twice"),
        (["--from", "tutel", *paths, out, "--ranks", 3], "ranks=3 is invalid for layer 'layers.1.blocks.1.mlp."
         "_moe_layer.': its 4 experts neither divide over 3 ranks nor 3 ranks over them"),
        (["--from", "tutel", *paths, out, "--ranks", 0], "ranks=0 is invalid: must be an integer >= 1"),
        (["--from", "tutel", *paths, out], "--ranks is required with --from tutel"),
        (["--from", "tutel", *paths, folder / "one.ckpt", "--ranks", 2], "has no {rank}: 2 ranks need one file each"),
        (["--from", "tutel", *paths, folder / "moe.pt", "--to", "moe_plugin", "--ranks", 2],
         "--ranks=2 is invalid with --to moe_plugin"),
        (["--from", "tutel", folder / "junk-0-of-1.ckpt", out, "--ranks", 1], "is not a checkpoint torch.load reads"),
        (["--from", "tutel", folder / "nothing-0-of-1.ckpt", out, "--ranks", 1], "does not exist"),
        (["--from", "tutel", folder / "objects-0-of-1.ckpt", out, "--ranks", 1], "holds Python objects beside its "
         "tensors (a training config?), which are not loaded here"),
        (["--from", "tutel", *swin[:31], swin[-1], out, "--ranks", 2], "has 32 experts, which neither divide over the "
         "files' 31 ranks nor 31 ranks over them (is a rank's file missing?)"),
        ([*paths, out], "4 sources given without --from tutel"),
        ([paths[0], folder / "x", "--ranks", 2], "--ranks given without --from tutel"),
    ]


def test_bad_inputs_are_one_line_and_exit_status_2(four_ranks, capsys):
    for arguments, says in bad_inputs(*four_ranks):
        capsys.readouterr()
        try:
            status = convert(*arguments)
        except SystemExit as exit:
            status = exit.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert status == 2, arguments
        assert len(lines) == 1 and lines[0].startswith("moe-plugin checkpoint: ") and says in lines[0], (says, lines)


def tutel_layers(E: int, D: int, H: int, world: int, rank: int, prefixes=PREFIXES) -> dict:
    """Real Tutel's moe_layer for each prefix, built as rank `rank` of `world` sees it (torch's fake process group:
    no other process; construction and load_state_dict never communicate)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from tutel import moe as tutel_moe
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        per_rank = E // world if world <= E else -(world // E)
        return {p: tutel_moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=D,
                                       experts={"type": "ffn", "count_per_node": per_rank,
                                                "hidden_size_per_expert": H})
                for p in prefixes}
    finally:
        dist.destroy_process_group()


def layer_state(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def test_files_load_into_real_tutel_at_their_world_size(tmp_path):
    """Files real Tutel saved on 4 ranks (4 experts) -> 8 ranks (each expert sliced in 2), 2 ranks and one file: each
    rank's file loads strictly into real Tutel's moe_layer built for that rank of that world, and holds what the
    4 ranks' layers held (the world-4 experts by this test's own slicing)."""
    pytest.importorskip("tutel", reason="real Tutel is not installed (it is not on PyPI; CI has none)")
    E, D, H = 4, 6, 12
    saved, model = [], {}
    for r in range(4):
        layers = tutel_layers(E, D, H, 4, r, PREFIXES[:2])
        saved.append({p + k: v for p, layer in layers.items() for k, v in layer.state_dict().items()})
        torch.save(saved[-1], tmp_path / f"{r}-of-4.ckpt")
    for key in saved[0]:
        model[key] = torch.cat([s[key] for s in saved]) if ".experts." in key else saved[0][key]
    model = {k: v for k, v in model.items() if not k.endswith("_num_global_experts")}
    for p in PREFIXES[:2]:   # every rank drew its own gate: the files must agree, so they take rank 0's
        for r in range(1, 4):
            saved[r][p + "gates.0.wg.weight"] = saved[0][p + "gates.0.wg.weight"]
            torch.save(saved[r], tmp_path / f"{r}-of-4.ckpt")
    full = checkpoints.read([tmp_path / f"{r}-of-4.ckpt" for r in range(4)])
    for W in (8, 2, 1):
        paths = checkpoints.write(full, str(tmp_path / str(W) / "{rank}-of-{size}.ckpt"), W)
        for r, path in enumerate(paths):
            state = torch.load(path, weights_only=True)
            assert_bit_equal(state, expected_rank(model, E, W, r))
            for p, layer in tutel_layers(E, D, H, W, r, PREFIXES[:2]).items():
                layer.load_state_dict(layer_state(state, p), strict=True)
                assert_bit_equal(layer.state_dict(), layer_state(expected_rank(model, E, W, r), p))


def module_tree(state: dict, make_layer) -> nn.Module:
    """A module whose state dict has state's keys: a make_layer() at each converted MoE layer, parameters elsewhere."""
    root = nn.Module()
    prefixes = sorted({k[:k.index("experts.")] for k in state if ".experts." in k})
    for prefix in prefixes:
        *path, name = prefix[:-1].split(".")
        _submodule(root, path).add_module(name, make_layer())
    for key, value in state.items():
        if not any(key.startswith(p) for p in prefixes):
            *path, name = key.split(".")
            _submodule(root, path).register_parameter(name, nn.Parameter(torch.empty_like(value)))
    return root


def _submodule(root: nn.Module, path: list) -> nn.Module:
    for name in path:
        if not hasattr(root, name):
            root.add_module(name, nn.Module())
        root = getattr(root, name)
    return root


def expert_parallel_from_converted(rank, world, full_path, rank_pattern, specs):
    """On each of 2 gloo ranks: a model with MoELayers at ep_size 2 given the converted full state dict (train's
    load_full_state_dict) and a MoELayer given this rank's converted Tutel file (names.tutel_to_moe, strict): equal,
    and equal to one process over both ranks' tokens (output, input gradient, aux loss, every gradient of this
    rank's share)."""
    full = torch.load(full_path, weights_only=True)
    mine = torch.load(rank_pattern.format(rank=rank, size=world), weights_only=True)["model"]
    worst = {}
    for spec in specs:
        prefix, config = spec["prefix"], dict(spec["config"], model_dim=EP_D, hidden_size=EP_H)
        reference = MoELayer(MoEConfig(**config)).double()
        reference.load_full_state_dict(layer_state(full, prefix))
        model = module_tree(full, lambda: MoELayer(MoEConfig(**config, ep_size=world)).double())
        load_full_state_dict(model, full)        # what moe-plugin train's models load with: each layer its share
        layer = model.get_submodule(prefix[:-1])
        from_tutel = MoELayer(MoEConfig(**config, ep_size=world)).double()
        from_tutel.load_state_dict(names.tutel_to_moe(layer_state(mine, prefix)), strict=True)
        for (name, a), b in zip(layer.state_dict().items(), from_tutel.state_dict().values()):
            assert torch.equal(a, b), name
        generator = torch.Generator().manual_seed(spec["seed"])
        xs = [torch.randn(n, EP_D, generator=generator, dtype=torch.float64) for n in spec["tokens"]]
        upstreams = [torch.randn(n, EP_D, generator=generator, dtype=torch.float64) for n in spec["tokens"]]
        names_, total, want = single_process_grads(reference, xs, upstreams, rank)
        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        ((y * upstreams[rank]).sum() + layer.aux_loss).backward()
        errors = {"y": relative_error(y.detach(), want["y"], floor=1e-12),
                  "x.grad": relative_error(x.grad, want["x.grad"], floor=1e-12),
                  "aux": relative_error(layer.aux_loss.detach(), want["aux"], floor=1e-12)}
        params = dict(layer.named_parameters())
        for name in names_:
            expected = want[name] if name.startswith("router.") else \
                expected_shard(total[name], name, layer.groups.layout, False)
            errors[name] = relative_error(params[name].grad, expected, floor=1e-12)
        worst[spec["name"]] = (max(errors.values()), max(errors, key=errors.get), layer.stats["dropped_fraction"])
    return worst


@pytest.mark.timeout(300)
def test_expert_parallel_over_2_ranks_from_converted_files_equals_one_process(tmp_path):
    """Swin-MoE files of 4 ranks (4 experts, D 6, H 8) -> the command: one MoELayer state dict, and Tutel files for
    2 ranks; 2 gloo ranks at ep_size 2 load them and compute what one process computes."""
    E = 4
    model = reference_model(E, EP_D, EP_H, prefixes=PREFIXES[:2])
    swin = swin_rank_files(model, E, tmp_path)
    assert convert("--from", "tutel", *swin, tmp_path / "moe.pt", "--to", "moe_plugin") == 0
    assert convert("--from", "tutel", *swin, tmp_path / "two" / "{rank}-of-{size}.pth", "--ranks", 2) == 0
    specs = [dict(name="top-2 drops", prefix=PREFIXES[0], seed=1, tokens=[13, 7],
                  config=dict(num_experts=E, top_k=2, capacity_factor=0.75, min_capacity=0, activation="relu",
                              bias=True)),
             dict(name="top-3 dropless, a rank without tokens", prefix=PREFIXES[1], seed=2, tokens=[9, 0],
                  config=dict(num_experts=E, top_k=3, capacity_factor=0.0, activation="relu", bias=True))]
    results = run_workers(expert_parallel_from_converted, 2, str(tmp_path / "moe.pt"),
                          str(tmp_path / "two" / "{rank}-of-{size}.pth"), specs, timeout=240)
    for rank, worst in enumerate(results):
        for spec in specs:
            error, where, _ = worst[spec["name"]]
            assert error < 1e-10, f"{spec['name']}: rank {rank} {where} off by {error:.3g}"
    assert results[0]["top-2 drops"][2] > 0     # the capacity really dropped tokens


def llama_model(E: int, D: int, H: int) -> dict:
    """One llama_ffn layer with a cosine_top gate: W_fc1, W_fc2 [E, D, H] and W_fc3 [E, H, D], flat as Tutel keeps them."""
    return {"norm.weight": torch.randn(D), "moe.gates.0.temperature": torch.randn(1),
            "moe.gates.0.cosine_projector.weight": torch.randn(3, D), "moe.gates.0.cosine_projector.bias": torch.randn(3),
            "moe.gates.0.sim_matrix": torch.randn(3, E), "moe.experts.W_fc1": torch.randn(E, D, H).view(-1),
            "moe.experts.W_fc2": torch.randn(E, D, H).view(-1), "moe.experts.W_fc3": torch.randn(E, H, D).view(-1)}


def test_llama_ffn_with_a_cosine_gate_4_to_2_ranks_and_to_moe_layer_names(tmp_path):
    E, D, H = 4, 6, 5
    model = llama_model(E, D, H)
    per_expert = D * H
    paths = [tmp_path / f"{r}-of-4.ckpt" for r in range(4)]
    for r, path in enumerate(paths):   # one expert each: its D*H values of every flat tensor
        torch.save({k: (v[r * per_expert:(r + 1) * per_expert].clone() if ".experts." in k else v)
                    for k, v in model.items()}, path)
    full = checkpoints.read(paths)
    assert full.num_experts == {"moe.": E}     # from the cosine gate's sim_matrix [J, E]
    assert_bit_equal(full.state, {**model, "moe._num_global_experts": torch.tensor(E)})
    two = checkpoints.write(full, str(tmp_path / "2" / "{rank}-of-{size}.ckpt"), 2)
    for r, path in enumerate(two):
        got = torch.load(path, weights_only=True)
        for key in ("moe.experts.W_fc1", "moe.experts.W_fc2", "moe.experts.W_fc3"):
            assert torch.equal(got[key], model[key][r * 2 * per_expert:(r + 1) * 2 * per_expert])
    ours = checkpoints.to_moe(checkpoints.read(two))
    fc1, fc2 = model["moe.experts.W_fc1"].view(E, D, H), model["moe.experts.W_fc2"].view(E, D, H)
    assert torch.equal(ours["moe.experts.w1_EDH"], torch.cat([fc1, fc2], dim=2))
    assert torch.equal(ours["moe.experts.w2_EHD"], model["moe.experts.W_fc3"].view(E, H, D))
    assert torch.equal(ours["moe.router.weight_ED"], model["moe.gates.0.sim_matrix"].t())
    with pytest.raises(ValueError, match="llama_ffn experts sliced over ranks"):
        checkpoints.write(full, str(tmp_path / "8" / "{rank}-of-{size}.ckpt"), 8)


def test_old_files_without_expert_count_or_gate_need_num_experts(tmp_path):
    """Swin-MoE rank files alone (no master: no gate) of 8 ranks with 2 experts each: the count must be given."""
    E = 16
    model = {k: v for k, v in reference_model(E, 6, 10, prefixes=PREFIXES[:1]).items() if is_expert(k)}
    paths = []
    for r in range(8):
        paths.append(tmp_path / f"m.pth.rank{r}")
        torch.save({"model": {k: (v[2 * r:2 * r + 2].clone() if v.dim() == 3 else
                                  v[2 * r:2 * r + 2].reshape(2, 1, -1).clone()) for k, v in model.items()}}, paths[-1])
    with pytest.raises(ValueError, match=r"says not how many experts it has .* give num_experts \(--num-experts\)"):
        checkpoints.read(paths)
    with pytest.raises(ValueError, match=r"\[2, 10, 6\] on each rank, but 32 experts on 8 ranks hold 4 each"):
        checkpoints.read(paths, num_experts=32)
    assert_bit_equal(checkpoints.read(paths, num_experts=E).state, with_counts(model, E))


def tutel_from_converted(rank, world, one_file, rank_pattern, specs, impl):
    """Tutel's moe_layer (impl "tutel": real Tutel; "drop-in": moe_plugin.tutel) on 2 gloo ranks, each loading its
    converted file, against the same on a group of this rank alone loading the one-file conversion: the same
    output, l_aux and input gradient for this rank's tokens."""
    import torch.distributed as dist
    if impl == "tutel":
        from tutel import moe as tutel_moe
    else:
        from moe_plugin import tutel as tutel_moe
    alone = [dist.new_group([r]) for r in range(world)][rank]
    full = torch.load(one_file, weights_only=True)
    mine = torch.load(rank_pattern.format(rank=rank, size=world), weights_only=True)
    worst = {}
    for spec in specs:
        E, prefix = spec["E"], spec["prefix"]

        def run(count, group, state):
            layer = tutel_moe.moe_layer(gate_type={"type": "top", "k": spec["k"], "capacity_factor": spec["cf"]},
                                        model_dim=spec["D"], group=group,
                                        experts={"type": "ffn", "count_per_node": count, "activation_fn": torch.relu,
                                                 "hidden_size_per_expert": spec["H"]})
            layer.load_state_dict(layer_state(state, prefix), strict=True)
            x = torch.randn(world, spec["T"], spec["D"], generator=torch.Generator().manual_seed(spec["seed"]))
            x = x[rank:rank + 1].requires_grad_()
            y = layer(x)
            (y.square().sum() + y.l_aux).backward()
            return y.detach(), y.l_aux.detach(), x.grad
        (y, aux, grad), (y_one, aux_one, grad_one) = run(E // world if world <= E else -(world // E), None, mine), \
            run(E, alone, full)
        worst[spec["name"]] = (float((y - y_one).abs().max()), float((aux - aux_one).abs()),
                               float((grad - grad_one).abs().max()), float(y.abs().max()), float(grad.abs().max()))
    return worst


def assert_same_on_both(results, specs):
    for rank, worst in enumerate(results):
        for spec in specs:
            dy, daux, dgrad, y_size, grad_size = worst[spec["name"]]
            assert y_size > 0 and grad_size > 0, (rank, spec["name"])
            assert dy <= 1e-5 * y_size and daux <= 1e-6 and dgrad <= 1e-5 * grad_size, (rank, spec["name"], worst)


def four_rank_files(tmp_path, D, H, sliced: bool) -> list:
    """Files of 4 ranks: a 4-expert layer, and (sliced) a 1-expert layer sliced over the 4, its fc2 bias padded."""
    layers = [reference_model(4, D, H, prefixes=PREFIXES[:1])]
    if sliced:
        layers.append({k: v for k, v in reference_model(1, D, H, prefixes=PREFIXES[1:2]).items() if PREFIXES[1] in k})
    paths = []
    for r in range(4):
        paths.append(tmp_path / f"{r}-of-4.ckpt")
        state = {}
        for layer in layers:
            state.update(expected_rank(layer, 4 if layer is layers[0] else 1, 4, r, pad=torch.randn))
        torch.save({k: v.clone() for k, v in state.items()}, paths[-1])
    return paths


@pytest.mark.timeout(300)
def test_the_drop_in_on_2_ranks_from_converted_files_equals_one_process(tmp_path):
    """Tutel files of 4 ranks -> 2 ranks' files and one file (the command); moe_plugin.tutel's moe_layer at expert
    parallelism over 2 gloo ranks computes what it computes on one process."""
    D, H = 6, 12
    paths = four_rank_files(tmp_path, D, H, sliced=False)
    assert convert("--from", "tutel", *paths, tmp_path / "all.ckpt", "--ranks", 1) == 0
    assert convert("--from", "tutel", *paths, tmp_path / "2" / "{rank}-of-{size}.ckpt", "--ranks", 2) == 0
    specs = [dict(name="top-2 drops", prefix=PREFIXES[0], E=4, k=2, cf=1.0, D=D, H=H, T=10, seed=1),
             dict(name="top-3 dropless", prefix=PREFIXES[0], E=4, k=3, cf=0.0, D=D, H=H, T=7, seed=2)]
    assert_same_on_both(run_workers(tutel_from_converted, 2, str(tmp_path / "all.ckpt"),
                                    str(tmp_path / "2" / "{rank}-of-{size}.ckpt"), specs, "drop-in", timeout=240), specs)


@pytest.mark.timeout(300)
def test_real_tutel_on_2_ranks_from_converted_files_equals_one_process(tmp_path):
    """Files of 4 ranks (a 4-expert layer; a 1-expert layer sliced over the 4, its fc2 bias padded) -> 2 ranks' files
    (the 1 expert sliced over 2) and one file; real Tutel computes the same from both (where Tutel is installed)."""
    pytest.importorskip("tutel", reason="real Tutel is not installed (it is not on PyPI; CI has none)")
    D, H = 6, 12
    full = checkpoints.read(four_rank_files(tmp_path, D, H, sliced=True))
    assert full.num_experts == {PREFIXES[0]: 4, PREFIXES[1]: 1}
    checkpoints.write(full, str(tmp_path / "all.ckpt"), 1)
    checkpoints.write(full, str(tmp_path / "2" / "{rank}-of-{size}.ckpt"), 2)
    specs = [dict(name="4 experts top-2 drops", prefix=PREFIXES[0], E=4, k=2, cf=1.0, D=D, H=H, T=10, seed=1),
             dict(name="1 expert sliced over 2 ranks", prefix=PREFIXES[1], E=1, k=1, cf=0.0, D=D, H=H, T=7, seed=2)]
    assert_same_on_both(run_workers(tutel_from_converted, 2, str(tmp_path / "all.ckpt"),
                                    str(tmp_path / "2" / "{rank}-of-{size}.ckpt"), specs, "tutel", timeout=240), specs)


def test_a_nested_namespace_is_kept_and_what_sits_beside_the_model_is_named(tmp_path, capsys):
    """Files holding {"run": {"model": state dict}, "epoch": ..., "max_accuracy": ...}: --namespace run/model reads
    them, the output keeps the nesting, and the command names what it left out."""
    E = 4
    model = reference_model(E, 6, 10, prefixes=PREFIXES[:1])
    paths = [tmp_path / f"{r}-of-2.ckpt" for r in range(2)]
    for r, path in enumerate(paths):
        torch.save({"run": {"model": {k: v.clone() for k, v in expected_rank(model, E, 2, r).items()}, "step": 7},
                    "epoch": 3, "max_accuracy": 0.5}, path)
    with pytest.raises(ValueError, match="does not hold a state dict"):
        checkpoints.read(paths)
    assert convert("--from", "tutel", *paths, tmp_path / "4" / "{rank}-of-{size}.ckpt", "--ranks", 4,
                   "--namespace", "run/model") == 0
    assert "left out the files' 'epoch', 'max_accuracy', 'run/step' (only the model is converted)" in \
        capsys.readouterr().out
    for r in range(4):
        got = torch.load(tmp_path / "4" / f"{r}-of-4.ckpt", weights_only=True)
        assert list(got) == ["run"] and list(got["run"]) == ["model"]
        assert_bit_equal(got["run"]["model"], expected_rank(model, E, 4, r))
