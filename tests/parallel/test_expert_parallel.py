"""Expert parallelism on 2 and 4 gloo processes against the single-process layer holding all experts."""
import pytest
import torch

from helpers.compare import relative_error
from helpers.expert_parallel import D, H, expected_shard, single_process_grads
from helpers.launch import run_workers
from moe_plugin import MoEConfig, MoELayer
from moe_plugin.parallel.groups import ExpertLayout, check_sizes

def compare_with_single_process(rank, world, specs):
    worst = {}
    for spec in specs:
        torch.manual_seed(spec["seed"])
        base = dict(model_dim=D, hidden_size=H, num_experts=spec["E"], top_k=spec["k"], capacity_factor=spec["cf"],
                    min_capacity=0, activation=spec.get("activation", "relu"), z_loss_coef=0.01,
                    bias=spec.get("bias", True))
        dtype = spec.get("dtype", torch.float64)    # fp32 runs the experts on grouped_mm, fp64 on the loop
        reference = MoELayer(MoEConfig(**base)).to(dtype)
        layer = MoELayer(MoEConfig(**base, ep_size=world, parallel=spec["r"], overlap_degree=spec["d"],
                                   a2a=spec["a2a"], node_size=spec.get("node"))).to(dtype)
        layer.load_full_state_dict(reference.state_dict())
        generator = torch.Generator().manual_seed(spec["seed"] + 1)
        xs = [torch.randn(n, D, generator=generator, dtype=torch.float64).to(dtype) for n in spec["tokens"]]
        upstreams = [torch.randn(n, D, generator=generator, dtype=torch.float64).to(dtype) for n in spec["tokens"]]

        names, total, mine = single_process_grads(reference, xs, upstreams, rank)

        for step in range(spec.get("steps", 1)):
            x = xs[rank].clone().requires_grad_()
            layer.zero_grad()
            y = layer(x)
            ((y * upstreams[rank]).sum() + layer.aux_loss).backward()
        got = {"y": y.detach(), "x.grad": x.grad, "aux": layer.aux_loss.detach()}
        params = dict(layer.named_parameters())
        errors = {}
        for name in got:
            errors[name] = relative_error(got[name], mine[name], floor=1e-12)
        for name in names:
            if name.startswith("router."):
                errors[name] = relative_error(params[name].grad, mine[name], floor=1e-12)
            else:
                want = expected_shard(total[name], name, layer.groups.layout, base["activation"] == "swiglu")
                errors[name] = relative_error(params[name].grad, want, floor=1e-12)
        worst[spec["name"]] = (max(errors.values()), max(errors, key=errors.get), layer.stats.get("tuned"))
    return worst


def _check(results, specs):
    for spec in specs:
        for rank, worst in enumerate(results):
            error, where, _ = worst[spec["name"]]
            tolerance = 1e-5 if spec.get("dtype") == torch.float32 else 1e-10
            assert error < tolerance, f"{spec['name']}: rank {rank} {where} off by {error:.3g}"


SPECS_2 = [
    dict(name="ep k2 fixed", E=4, k=2, cf=1.25, r=1, d=1, a2a="flat", tokens=[13, 7], seed=1),
    dict(name="ep dropless overlap3 zero tokens", E=4, k=2, cf=0.0, r=1, d=3, a2a="flat", tokens=[10, 0], seed=2),
    dict(name="gathered r0 drops", E=4, k=1, cf=0.5, r=0, d=1, a2a="flat", tokens=[9, 11], seed=3),
    dict(name="ep 2dh degenerate swiglu", E=2, k=2, cf=-1.0, r=1, d=2, a2a="2dh", tokens=[5, 8], seed=4,
         activation="swiglu"),
    dict(name="sliced experts r1", E=1, k=1, cf=0.0, r=1, d=1, a2a="flat", tokens=[6, 3], seed=5),
    dict(name="sliced experts r2 gelu", E=1, k=1, cf=1.0, r=2, d=2, a2a="flat", tokens=[0, 7], seed=6,
         activation="gelu"),
    dict(name="per-load tuner", E=1, k=1, cf=-1.0, r="auto", d="auto", a2a="flat", tokens=[7, 12], seed=7,
         steps=10),
]

# fp32: the expert compute on grouped_mm in every expert-parallel mode, each activation, with and without biases
SPECS_2_FP32 = [
    dict(name="fp32 ep relu bias", E=4, k=2, cf=0.8, r=1, d=1, a2a="flat", tokens=[21, 9], seed=31,
         dtype=torch.float32),
    dict(name="fp32 ep gelu no bias overlap", E=4, k=2, cf=0.0, r=1, d=2, a2a="flat", tokens=[12, 17], seed=32,
         dtype=torch.float32, activation="gelu", bias=False),
    dict(name="fp32 gathered silu", E=4, k=3, cf=1.0, r=0, d=1, a2a="flat", tokens=[8, 15], seed=33,
         dtype=torch.float32, activation="silu"),
    dict(name="fp32 sliced r2 swiglu no bias", E=1, k=1, cf=0.0, r=2, d=1, a2a="flat", tokens=[11, 6], seed=34,
         dtype=torch.float32, activation="swiglu", bias=False),
    dict(name="fp32 sliced r1 swiglu bias", E=1, k=1, cf=-1.0, r=1, d=2, a2a="flat", tokens=[5, 13], seed=35,
         dtype=torch.float32, activation="swiglu"),
]

SPECS_4 = [
    dict(name="ep4 flat", E=8, k=2, cf=1.0, r=1, d=1, a2a="flat", tokens=[12, 12, 12, 12], seed=11),
    dict(name="ep4 2dh uneven", E=8, k=2, cf=-1.0, r=1, d=2, a2a="2dh", node=2, tokens=[5, 0, 17, 8], seed=12),
    dict(name="ep4 k4 2dh", E=4, k=4, cf=0.0, r=1, d=1, a2a="2dh", node=2, tokens=[3, 9, 1, 6], seed=13),
    dict(name="slice2 r2 swiglu", E=2, k=1, cf=0.0, r=2, d=1, a2a="flat", tokens=[6, 9, 0, 4], seed=14,
         activation="swiglu"),
    dict(name="slice2 r1 overlap", E=2, k=2, cf=1.25, r=1, d=2, a2a="flat", tokens=[7, 7, 3, 5], seed=15),
    dict(name="slice2 r0 gelu", E=2, k=2, cf=0.7, r=0, d=1, a2a="flat", tokens=[4, 10, 2, 0], seed=16,
         activation="gelu"),
    dict(name="slice2 2dh overlap", E=2, k=1, cf=0.0, r=2, d=3, a2a="2dh", node=2, tokens=[8, 1, 5, 5], seed=17),
    dict(name="auto", E=4, k=2, cf=0.0, r="auto", d="auto", a2a="flat", tokens=[9, 4, 6, 2], seed=18, steps=12),
]


@pytest.mark.timeout(300)
def test_two_processes_match_single_process():
    _check(run_workers(compare_with_single_process, 2, SPECS_2, timeout=240), SPECS_2)


@pytest.mark.timeout(300)
def test_two_processes_match_single_process_in_fp32_on_grouped_mm():
    _check(run_workers(compare_with_single_process, 2, SPECS_2_FP32, timeout=240), SPECS_2_FP32)


@pytest.mark.timeout(300)
def test_four_processes_match_single_process():
    results = run_workers(compare_with_single_process, 4, SPECS_4, timeout=240)
    _check(results, SPECS_4)
    tuned = [worst["auto"][2] for worst in results]
    assert tuned[0] is not None and all(t == tuned[0] for t in tuned), f"ranks chose differently: {tuned}"


def test_impossible_sizes_say_what_works():
    with pytest.raises(ValueError, match=r"ep_size=4 cannot hold num_experts=6 .* sizes that work: \[1, 2, 3, 6, 12"):
        check_sizes(6, 8, 4)
    with pytest.raises(ValueError, match="sizes that work"):
        check_sizes(2, 9, 4)      # 9 hidden units cannot be cut in 2 slices
    with pytest.raises(ValueError, match=r"r=3 is not possible .* possible: \[0, 1, 2, 4\]"):
        ExpertLayout(2, 8, 8, 0).check_degree(3)


def test_parallel_layer_needs_torch_distributed():
    with pytest.raises(ValueError, match="ep_size=2 needs torch.distributed"):
        MoELayer(MoEConfig(model_dim=4, hidden_size=4, num_experts=2, ep_size=2))


def test_slot_layout_helpers():
    layout = ExpertLayout(num_experts=2, hidden_size=8, ep_size=8, ep_rank=5)
    assert (layout.slices, layout.first_expert, layout.slice_index, layout.local_hidden) == (4, 1, 1, 2)
    assert layout.destinations(expert=1, source_rank=3, r=2) == [5, 7]
    assert layout.destinations(expert=0, source_rank=3, r=4) == [0, 1, 2, 3]
    assert ExpertLayout(8, 8, 4, 3).destinations(expert=7, source_rank=0, r=1) == [3]


def test_segment_permutation_against_a_loop():
    from moe_plugin.parallel.all_to_all import segment_permutation
    sizes_AB = torch.randint(0, 4, (3, 5))
    rows, start = {}, 0
    for a in range(3):
        for b in range(5):
            rows[a, b] = list(range(start, start + int(sizes_AB[a, b])))
            start += int(sizes_AB[a, b])
    expected = [i for b in range(5) for a in range(3) for i in rows[a, b]]
    assert segment_permutation(sizes_AB).tolist() == expected


def graph_is_freed(rank, world):
    import gc
    import weakref
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=4, ep_size=world, overlap_degree=2))
    x = torch.randn(10, D, requires_grad=True)
    layer(x).sum().backward()
    alive = weakref.ref(x)
    del x
    layer.aux_loss = None          # the router's graph (which keeps x) is meant to live until the next step
    gc.collect()
    return alive() is None


@pytest.mark.timeout(120)
def test_exchange_leaves_no_reference_cycle():
    """A started all-to-all's work object holds its output, whose graph holds the work: that cycle
    kept every step's activations alive until the process ran out of memory."""
    assert run_workers(graph_is_freed, 2, timeout=90) == [True, True]
