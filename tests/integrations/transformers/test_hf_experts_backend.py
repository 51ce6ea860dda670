"""The HF experts backend "moe_plugin" against HF's own grouped_mm backend (CPU, tiny random configs).

Every experts class of transformers that uses HF's experts interface (@use_experts_implementation) is found by
scanning transformers' modeling files, built from its family's config class at tiny sizes, and run both ways:
outputs and every gradient (input, routing weights, each parameter) agree. Whole models (logits and every
gradient) for the families tests/helpers/hf.py builds, selected both ways HF offers.
What this module tests (moved here from the README):

- **Every experts class**, found by scanning transformers' modeling files (65 classes; the scan must
  find at least 60). Each is built from its family's config class at tiny sizes (D 24, H 20, 6 experts,
  top-3, 13 tokens, one expert with no tokens). Output, input gradient, routing-weight gradient and every
  parameter gradient equal the `grouped_mm` backend's to 1e-5 relative (fp32).
- **Whole models**, for every table family whose experts use HF's experts interface (tiny models from
  `helpers.hf`). A folder saved by a `grouped_mm` model is loaded with
  `from_pretrained(..., experts_implementation="moe_plugin")`. Its logits and every gradient equal the
  `grouped_mm` model's. Each gradient is held to 1e-5 relative to the larger of its own largest entry and
  1e-3 of the model's largest gradient. The reason is HY-V4's hyper-connection gradients: they are 1e-4 to
  1e-7 of the others, and fp32 rounding alone moves them by 1e-5 of themselves; HF's grouped_mm against
  fp64 eager shows the same. `set_experts_implementation("moe_plugin")` and back to `"grouped_mm"` is
  tested on Mixtral and DeepSeek-V3. A spy checks that the backend ran, and that it no longer runs after
  switching back.
- **Which gates run fused:** gpt-oss's, clamped SwiGLU, relu² and tanh GeGLU do. MuseSpark's post-expert
  norm, gelu_new, and DeepSeek-V4 with a GELU act_fn (the clamp rule suggests SwiGLU, the probe rejects it)
  run on HF's functions. Mixtral experts with `hidden_act` gelu and gelu_pytorch_tanh (fused GeGLU), and
  gelu_new and relu (HF's act_fn), all equal grouped_mm.
- **HF's EP sentinel routes:** index `num_experts` with weight 0, for Mixtral, gpt-oss and MuseSpark,
  equal grouped_mm. The index is skipped like HF's eager experts without EP; a larger one is an error.
- **bf16:** Mixtral and gpt-oss experts stay within 2e-2 of grouped_mm and keep bf16 parameters.
- **HF's EP on 2 gloo processes** (slow): `DistributedConfig(fsdp_size=2, ep_size=2)`. On each rank the
  backend gives grouped_mm's logits and every local gradient, and each rank's logits equal one process on
  that rank's batch.
- **A gate that fails on the fp64 probe** stays on HF's function and still equals grouped_mm.
- **Weight gradients in HF's layout:** `experts.weight_grad` of a transposed view comes in the view's
  strides, with the same values.
"""
import copy
import inspect
import importlib
import pathlib
import re

import pytest
import torch

from helpers.compare import assert_close_rel
from helpers.hf import family_config, model_class, needs_transformers, tokens, transformers

pytestmark = [needs_transformers, pytest.mark.timeout(300)]
TOL = 1e-5
BF16_TOL = 2e-2
D, H, E, K, T = 24, 20, 6, 3, 13        # T odd; HF's grouped_mm needs rows of 16-byte multiples (bf16: H 24)
SIZES = {"hidden_size": D, "moe_hidden_size": D, "intermediate_size": H, "moe_intermediate_size": H,
         "num_experts": E, "num_local_experts": E, "n_routed_experts": E, "moe_num_experts": E}


def _modeling_files():
    """(family, modeling module name) of every transformers model whose experts use HF's experts interface."""
    if transformers is None:
        return []
    root = pathlib.Path(transformers.__file__).parent / "models"
    return [(path.parent.name, path.stem) for path in sorted(root.glob("*/modeling_*.py"))
            if "@use_experts_implementation" in path.read_text()]


MODELING_FILES = _modeling_files()


def experts_classes(family, stem):
    module = importlib.import_module(f"transformers.models.{family}.{stem}")
    return [obj for name, obj in vars(module).items()
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and issubclass(obj, torch.nn.Module)
            and hasattr(obj, "_apply_gate") and hasattr(obj.forward, "__wrapped__")]


def tiny_experts(family, cls, implementation, dtype=torch.float32):
    """cls built from the first config class of the family holding every key cls reads, at the sizes above
    (hidden width 24 in bf16)."""
    sizes = {**SIZES, "intermediate_size": 24, "moe_intermediate_size": 24} if dtype == torch.bfloat16 else SIZES
    needed = set(re.findall(r"config\.(\w+)", inspect.getsource(cls.__init__)))
    configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    candidates = sorted((c for c in vars(configs).values() if inspect.isclass(c)
                         and issubclass(c, transformers.PretrainedConfig) and c.__module__ == configs.__name__),
                        key=lambda c: ("Text" not in c.__name__, c.__name__))
    config = next(config for config in (c() for c in candidates) if all(hasattr(config, n) for n in needed))
    for name in needed & set(sizes):
        value = getattr(config, name)
        setattr(config, name, type(value)([sizes[name]] * len(value)) if isinstance(value, (list, tuple)) else sizes[name])
    config._experts_implementation = implementation
    extra = {"intermediate_size": sizes["intermediate_size"]} if "intermediate_size" in inspect.signature(cls.__init__).parameters else {}
    experts = cls(config, **extra).to(dtype)
    assert experts.num_experts == E, f"{cls.__name__} did not take the tiny sizes"
    return experts


def draw_parameters(module, generator):
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def routes(generator, num_experts=E, tokens_=T, k=K, sentinel=False, repeated=False):
    """Distinct experts per token, the last expert never chosen (an expert with no rows); with sentinel, HF's EP
    marks some routes as another rank's (index num_experts, weight 0); repeated: every choice among the first
    two experts, so tokens name one expert more than once and an expert gets more rows than there are tokens
    (DeepSeek-V4's hash layers route by a table that may repeat)."""
    if repeated:
        index = torch.randint(0, 2, (tokens_, k), generator=generator)
    else:
        index = torch.stack([torch.randperm(num_experts - 1, generator=generator)[:k] for _ in range(tokens_)])
    weight = torch.rand(tokens_, k, generator=generator) + 0.1
    if sentinel:
        off_rank = torch.rand(tokens_, k, generator=generator) < 0.4
        index, weight = index.masked_fill(off_rank, num_experts), weight.masked_fill(off_rank, 0.0)
    return index, weight


def run_experts(experts, x, index, weight):
    """Output and every gradient: input, routing weights, each parameter."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    y = experts(x, index, weight)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype))
    return {"output": y.detach(), "input grad": x.grad, "routing weight grad": weight.grad,
            **{f"grad of {n}": p.grad for n, p in experts.named_parameters()}}


def compare_experts(family, cls, seed, dtype=torch.float32, tol=TOL, sentinel=False, repeated=False):
    generator = torch.Generator().manual_seed(seed)
    theirs = tiny_experts(family, cls, "grouped_mm", dtype)
    draw_parameters(theirs, generator)
    ours = copy.deepcopy(theirs)
    ours.config = copy.deepcopy(theirs.config)
    ours.config._experts_implementation = "moe_plugin"
    if sentinel:
        theirs._is_expert_parallel = ours._is_expert_parallel = True
    x = (torch.randn(T, D, generator=generator) * 3).to(dtype)    # large enough to reach clamp limits
    index, weight = routes(generator, sentinel=sentinel, repeated=repeated)
    expected, actual = run_experts(theirs, x, index, weight.to(dtype)), run_experts(ours, x, index, weight.to(dtype))
    assert expected.keys() == actual.keys()
    for what in expected:
        assert_close_rel(actual[what], expected[what], tol, f"{cls.__name__} {what}")
    return ours


def test_the_scan_finds_hf_experts_classes():
    found = [cls for family, stem in MODELING_FILES for cls in experts_classes(family, stem)]
    assert len(found) >= 60, f"only {len(found)} experts classes found"
    assert {"MixtralExperts", "GptOssExperts", "NemotronHExperts", "DeepseekV3Experts"} <= {c.__name__ for c in found}


@pytest.mark.parametrize("family, stem", MODELING_FILES, ids=[f for f, _ in MODELING_FILES])
def test_every_hf_experts_class_matches_grouped_mm(family, stem, fresh_seed):
    classes = experts_classes(family, stem)
    assert classes, f"{stem} uses @use_experts_implementation but no experts class was found"
    for cls in classes:
        compare_experts(family, cls, fresh_seed)


def test_fused_path_is_taken_where_the_layer_computes_hf_gate():
    """Families whose gate the layer computes run fused; a post-expert norm or an unknown act_fn on HF's own
    functions (the comparisons above hold for both)."""
    from moe_plugin.integrations.transformers.experts_backend import activation_of
    cases = {("mixtral", "MixtralExperts"): "swiglu", ("gpt_oss", "GptOssExperts"): "swiglu_oai",
             ("glm5_next", "Glm5NextTextExperts"): "swiglu", ("nemotron_h", "NemotronHExperts"): "relu2",
             ("gemma4", "Gemma4TextExperts"): "geglu_tanh", ("muse_spark", "MuseSparkExperts"): None}
    for (family, name), expected in cases.items():
        cls = next(c for c in experts_classes(family, f"modeling_{family}") if c.__name__ == name)
        activation = activation_of(tiny_experts(family, cls, "moe_plugin"))
        assert (activation and activation.name) == expected, f"{name}: {activation}"
    mixtral = tiny_experts("mixtral", experts_classes("mixtral", "modeling_mixtral")[0], "moe_plugin")
    mixtral.act_fn = transformers.activations.ACT2FN["gelu_new"]      # no layer activation computes it
    assert activation_of(mixtral) is None
    v4 = tiny_experts("deepseek_v4", experts_classes("deepseek_v4", "modeling_deepseek_v4")[0], "moe_plugin")
    assert activation_of(v4) == ("swiglu", 10.0, None)
    v4.act_fn = transformers.activations.ACT2FN["gelu"]     # the clamp rule reads SwiGLU; the probe sees GeLU
    assert activation_of(v4) is None


def test_a_gate_the_probe_cannot_run_stays_on_hf_function(fresh_seed, monkeypatch):
    """A family gate that fails on the fp64 probe (say, parameters of another dtype) is not matched: HF's gate runs."""
    from moe_plugin.integrations.transformers import experts_backend
    cls = next(c for c in experts_classes("glm5_next", "modeling_glm5_next") if c.__name__ == "Glm5NextTextExperts")
    hf_gate = cls._apply_gate

    def fp32_only_gate(self, gate_up):
        if gate_up.dtype != torch.float32:
            raise RuntimeError("expected fp32")
        return hf_gate(self, gate_up)
    monkeypatch.setattr(cls, "_apply_gate", fp32_only_gate)
    monkeypatch.setattr(experts_backend, "_checked", {})
    ours = compare_experts("glm5_next", cls, fresh_seed)
    assert experts_backend.activation_of(ours) is None


@pytest.mark.parametrize("hidden_act, fused", [("gelu", "geglu"), ("gelu_pytorch_tanh", "geglu_tanh"),
                                               ("gelu_new", None), ("relu", None)])
def test_mixtral_experts_with_other_hidden_acts_match_grouped_mm(hidden_act, fused, fresh_seed, monkeypatch):
    """HF's model testers build MoE models with hidden_act="gelu": gated GELU runs fused, others on HF's act_fn."""
    from moe_plugin.integrations.transformers.experts_backend import activation_of
    monkeypatch.setitem(SIZES, "hidden_act", hidden_act)
    cls = experts_classes("mixtral", "modeling_mixtral")[0]
    ours = compare_experts("mixtral", cls, fresh_seed)
    assert (activation_of(ours) and activation_of(ours).name) == fused


@pytest.mark.parametrize("family, name", [("mixtral", "MixtralExperts"), ("gpt_oss", "GptOssExperts"),
                                          ("muse_spark", "MuseSparkExperts")])
def test_hf_expert_parallel_sentinel_routes_are_dropped_as_grouped_mm_drops_them(family, name, fresh_seed):
    cls = next(c for c in experts_classes(family, f"modeling_{family}") if c.__name__ == name)
    compare_experts(family, cls, fresh_seed, sentinel=True)


@pytest.mark.parametrize("family, name", [("mixtral", "MixtralExperts"), ("deepseek_v4", "DeepseekV4Experts"),
                                          ("muse_spark", "MuseSparkExperts")])
def test_a_token_naming_one_expert_several_times_matches_grouped_mm(family, name, fresh_seed):
    cls = next(c for c in experts_classes(family, f"modeling_{family}") if c.__name__ == name)
    compare_experts(family, cls, fresh_seed, repeated=True)


@pytest.mark.parametrize("family, name", [("mixtral", "MixtralExperts"), ("gpt_oss", "GptOssExperts")])
def test_bf16_experts_stay_close_to_grouped_mm(family, name, fresh_seed):
    cls = next(c for c in experts_classes(family, f"modeling_{family}") if c.__name__ == name)
    ours = compare_experts(family, cls, fresh_seed, dtype=torch.bfloat16, tol=BF16_TOL)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())


def full_model_families():
    """The families helpers.hf builds as whole tiny models whose experts use HF's experts interface."""
    if transformers is None:
        return []
    from helpers import hf
    built = {**hf.SPECIFIC, **getattr(hf, "MORE", {})}
    with_interface = {family for family, _ in MODELING_FILES}
    return sorted(f for f in built if f in with_interface)


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_model_results(actual, expected):
    """Logits and each gradient within TOL of grouped_mm, relative to the larger of the tensor's own largest entry
    and helpers.hf.gradient_floor: some families hold parameters whose gradients are 1e-4 to 1e-7 of the rest
    (the hyper-connections of HY-V4, GLM-5-Next and DeepSeek-V4), where fp32 rounding alone moves them by more
    than TOL of themselves (HF's own grouped_mm against fp64 eager: up to 1.4e-5)."""
    from helpers.hf import gradient_floor
    (logits, grads), (hf_logits, hf_grads) = actual, expected
    assert_close_rel(logits, hf_logits, TOL, "logits")
    assert grads.keys() == hf_grads.keys() and hf_grads
    largest = max(float(g.abs().max()) for g in hf_grads.values())
    for name, grad in hf_grads.items():
        floor = gradient_floor(name, largest)
        scale = max(float(grad.abs().max()), floor) / max(float(grad.abs().max()), 1e-30)
        assert_close_rel(grads[name], grad, TOL * scale, f"grad of {name}")


@pytest.fixture
def backend_calls(monkeypatch):
    """How many times the backend ran (once per MoE layer and forward)."""
    from moe_plugin.integrations.transformers import experts_backend
    calls, routes_ = [], experts_backend._routes
    monkeypatch.setattr(experts_backend, "_routes", lambda *a: calls.append(1) or routes_(*a))
    return calls


@pytest.mark.parametrize("family", full_model_families())
def test_from_pretrained_with_the_backend_gives_grouped_mm_logits_and_grads(family, fresh_seed, tmp_path,
                                                                            backend_calls):
    torch.manual_seed(fresh_seed)
    hf = model_class(family)._from_config(family_config(family), experts_implementation="grouped_mm")
    hf.save_pretrained(tmp_path)
    ids = tokens(fresh_seed + 1)
    expected = logits_and_grads(hf, ids)
    assert not backend_calls
    loaded = model_class(family).from_pretrained(tmp_path, experts_implementation="moe_plugin")
    assert loaded.config._experts_implementation == "moe_plugin"
    assert_same_model_results(logits_and_grads(loaded, ids), expected)
    assert backend_calls, "the backend never ran"


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_set_experts_implementation_switches_to_the_backend_and_back(family, fresh_seed, backend_calls):
    torch.manual_seed(fresh_seed)
    hf = model_class(family)._from_config(family_config(family), experts_implementation="grouped_mm")
    ids = tokens(fresh_seed + 1)
    expected = logits_and_grads(hf, ids)
    hf.set_experts_implementation("moe_plugin")
    assert_same_model_results(logits_and_grads(hf, ids), expected)
    assert backend_calls
    hf.set_experts_implementation("grouped_mm")     # and back: HF's own again
    del backend_calls[:]
    assert_same_model_results(logits_and_grads(hf, ids), expected)
    assert not backend_calls


def test_expert_index_num_experts_is_skipped_as_hf_eager_skips_it_and_beyond_is_an_error(fresh_seed):
    cls = experts_classes("mixtral", "modeling_mixtral")[0]
    experts = {impl: tiny_experts("mixtral", cls, impl) for impl in ("eager", "moe_plugin")}
    draw_parameters(experts["eager"], torch.Generator().manual_seed(fresh_seed))
    experts["moe_plugin"].load_state_dict(experts["eager"].state_dict())
    index, weight = routes(torch.Generator().manual_seed(fresh_seed + 1))
    index[::2, 0] = E
    x = torch.randn(T, D)
    assert_close_rel(experts["moe_plugin"](x, index, weight), experts["eager"](x, index, weight), TOL, "output")
    with pytest.raises(RuntimeError, match="out of bounds|outside"):
        experts["moe_plugin"](x, index.clamp(max=E - 1).index_fill(1, torch.tensor([1]), E + 1), weight)


def _hf_ep_worker(rank, world_size, family, folder, seed):
    """HF's own expert parallelism (DistributedConfig(fsdp_size=2, ep_size=2): HF's all-to-all EP, each rank its
    own batch and half the experts) with grouped_mm and with moe_plugin: logits, loss and every local gradient."""
    from transformers.distributed import DistributedConfig
    import moe_plugin.integrations.transformers.experts_backend as backend
    calls, routes_ = [], backend._routes
    backend._routes = lambda *a: calls.append(1) or routes_(*a)
    ids, results = tokens(seed + rank), {}
    for implementation in ("grouped_mm", "moe_plugin"):
        model = model_class(family).from_pretrained(
            folder, experts_implementation=implementation,
            distributed_config=DistributedConfig(fsdp_size=world_size, ep_size=world_size))
        experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]
        assert experts and all(m._is_expert_parallel and m.num_experts == 3 for m in experts)
        out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                 for n, p in model.named_parameters() if p.grad is not None}
        results[implementation] = (out.logits.detach(), grads, len(calls))
    (logits, grads, ran), (hf_logits, hf_grads, hf_ran) = results["moe_plugin"], results["grouped_mm"]
    assert hf_ran == 0 and ran > 0, (hf_ran, ran)
    assert_close_rel(logits, hf_logits, TOL, f"rank {rank} logits")
    assert grads.keys() == hf_grads.keys() and any("experts" in n for n in grads)
    for name, grad in hf_grads.items():
        assert_close_rel(grads[name], grad, TOL, f"rank {rank} grad of {name}")
    return logits.tolist()     # not a tensor: its shared memory would go with this process


@pytest.mark.slow
def test_hf_expert_parallelism_on_two_gloo_processes_equals_grouped_mm_and_one_process(fresh_seed, tmp_path):
    from helpers.launch import run_workers
    torch.manual_seed(fresh_seed)
    model = model_class("mixtral")._from_config(family_config("mixtral"))   # 6 experts: 3 per rank
    model.save_pretrained(tmp_path)
    logits = run_workers(_hf_ep_worker, 2, "mixtral", str(tmp_path), fresh_seed, timeout=400)
    for rank, rank_logits in enumerate(logits):
        ids = tokens(fresh_seed + rank)
        assert_close_rel(torch.tensor(rank_logits), model(ids).logits.detach(), TOL, f"rank {rank} logits vs one process")


def test_weight_grads_of_hf_layout_views_come_in_that_layout(fresh_seed):
    """experts.weight_grad: the gradient of a transposed view of HF's [E, out, in] weights is computed in that
    layout (autograd then hands HF's parameter a contiguous gradient, no copy), with the same values."""
    from moe_plugin import ops
    from moe_plugin.experts import weight_grad
    hf_weight = torch.randn(E, H, D)
    x_RD, grad_RH = torch.randn(17, D), torch.randn(17, H)
    offs_E = ops.offsets([3, 0, 5, 4, 2, 1])
    view_EDH = hf_weight.transpose(1, 2)
    grad = weight_grad(x_RD, grad_RH, offs_E, view_EDH)
    assert grad.stride() == view_EDH.stride()
    assert_close_rel(grad, weight_grad(x_RD, grad_RH, offs_E, view_EDH.contiguous()), TOL, "weight grad")
    assert weight_grad(x_RD, grad_RH, offs_E, view_EDH.contiguous()).is_contiguous()
