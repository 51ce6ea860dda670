"""Which kernels run (MOE_PLUGIN_KERNELS, build failures), and the layer on each kernel set and under
torch.compile, against the einsum reference / eager mode."""
import os
import time
import warnings
from pathlib import Path

import pytest
import torch

from moe_plugin import ops
from moe_plugin.cli import main as cli_main
from moe_plugin.ops import choice, native, torch_ops
from helpers.compare import relative_error
from helpers.reference import fast, make_layer, outputs_and_grads, reference


@pytest.fixture
def fresh_choice(monkeypatch):
    """Forget which kernels were chosen (and so which fallbacks were warned about), before and after the test."""
    choice._choose.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    choice._choose.cache_clear()


def test_unknown_kernel_choice_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(ops.ENV, "cuda-graphs")
    with pytest.raises(ValueError, match=r"MOE_PLUGIN_KERNELS='cuda-graphs' is not a kernel choice; allowed: auto, native, torch"):
        make_layer()(torch.randn(3, 12, dtype=torch.float64))


def test_torch_choice_never_builds(fresh_choice):
    fresh_choice.setenv(ops.ENV, "torch")
    fresh_choice.setattr(native, "load", lambda: pytest.fail("the torch choice must not build the native kernels"))
    assert ops.kernels_for(torch.device("cpu"))[:2] == (torch_ops, "torch")


def test_failed_build_falls_back_once_with_the_reason(fresh_choice):
    fresh_choice.setenv(ops.ENV, "auto")
    fresh_choice.setattr(native, "load", lambda: (None, "building csrc/ failed: error: expected ';'"))
    with pytest.warns(RuntimeWarning, match=r"using the torch kernels on cpu: building csrc/ failed: error: expected ';'"):
        assert ops.kernels_for(torch.device("cpu"))[1] == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.kernels_for(torch.device("cpu"))[1] == "torch"     # said once only
    fresh_choice.setenv(ops.ENV, "native")
    with pytest.raises(RuntimeError, match=r"MOE_PLUGIN_KERNELS=native but the native kernels for cpu are unavailable: building"):
        ops.kernels_for(torch.device("cpu"))


def test_build_reports_a_compile_error(tmp_path, monkeypatch):
    for name in native.SOURCES:
        (tmp_path / name).write_text("this is not C++\n")
    monkeypatch.setattr(native, "csrc_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "MODULE_NAME", "moe_plugin_broken_build_test")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    module, why = native.load.__wrapped__()
    assert module is None and why.startswith("building csrc/ failed:")


def test_missing_compiler_or_sources_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: "/usr/bin/ninja" if name == "ninja" else None)
    assert native.load.__wrapped__() == (None, "no C++ compiler (c++ / g++) on PATH")
    monkeypatch.setattr(native, "csrc_dir", lambda: tmp_path)
    module, why = native.load.__wrapped__()
    assert module is None and why.startswith("C++ sources not found") and "pip install -e ." in why


def test_info_names_the_active_kernels(capsys, monkeypatch):
    monkeypatch.setenv(ops.ENV, "torch")
    assert cli_main(["info"]) == 0
    assert "cpu: torch (MOE_PLUGIN_KERNELS=torch)" in capsys.readouterr().out


LAYER_CASES = [
    dict(top_k=2, capacity_factor=0.5),                                     # dropped tokens
    dict(top_k=3, num_experts=5, capacity_factor=0.0, bias=False),          # dropless, k = 3
    dict(top_k=2, capacity_factor=1.0, batch_prioritized_routing=True, activation="swiglu"),
]


@pytest.mark.parametrize("choice", ["native", "torch"])
@pytest.mark.parametrize("overrides", LAYER_CASES)
def test_layer_on_each_kernel_set_matches_einsum(fresh_choice, choice, overrides):
    if choice == "native" and native.load()[0] is None:
        pytest.skip(reason=f"native kernels unavailable: {native.load()[1]}")
    fresh_choice.setenv(ops.ENV, choice)
    layer = make_layer(**overrides)
    x = torch.randn(2, 23, 12, dtype=torch.float64)
    y, aux, grads = outputs_and_grads(fast(layer), layer, x)
    ref_y, ref_aux, ref_grads = outputs_and_grads(reference(layer), layer, x)
    assert relative_error(y, ref_y) < 1e-10 and relative_error(aux, ref_aux) < 1e-10
    for name, grad in grads.items():
        assert relative_error(grad, ref_grads[name]) < 1e-10, name


def test_compiled_layer_matches_eager():
    layer = make_layer(top_k=2, capacity_factor=0.75)
    x = torch.randn(3, 11, 12, dtype=torch.float64)
    y, aux, grads = outputs_and_grads(fast(layer), layer, x)
    compiled = torch.compile(layer)
    compiled_y, compiled_aux, compiled_grads = outputs_and_grads(lambda x: (compiled(x), layer.aux_loss), layer, x)
    assert relative_error(compiled_y, y) < 1e-12 and relative_error(compiled_aux, aux) < 1e-12
    for name, grad in grads.items():
        assert relative_error(compiled_grads[name], grad) < 1e-12, name


def test_compiled_graph_holds_the_custom_ops():
    """Dynamo traces the routing ops into its graph (through their fake implementations)."""
    targets = set()

    def recording_backend(graph_module, example_inputs):
        targets.update(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward
    layer = make_layer(dtype=torch.float32)
    torch.compile(layer, backend=recording_backend)(torch.randn(10, 12)).sum().backward()
    assert "moe_plugin.route_slots.default" in targets


def test_a_built_library_loads_past_a_left_over_lock(monkeypatch):
    """A process killed while building leaves torch's lock file; with the library built, loading ignores it."""
    import torch.utils.cpp_extension
    if native.load()[0] is None:
        pytest.skip(reason=f"native kernels unavailable here: {native.load()[1]}")
    library = Path(native.load()[0].__file__)
    lock = library.parent / "lock"
    lock.touch()

    def build(*args, **kwargs):
        raise AssertionError("built again: torch's build would wait forever on the lock")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    try:
        module, why = native.load.__wrapped__()
    finally:
        lock.unlink(missing_ok=True)
    assert module is not None and why.startswith("built from csrc/")


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    lock = tmp_path / "lock"
    lock.touch()
    native._clear_stale_lock(lock)
    assert lock.exists()                     # a build may be running
    old = time.time() - native.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    native._clear_stale_lock(lock)
    assert not lock.exists() and "stale build lock" in capsys.readouterr().err
    native._clear_stale_lock(lock)           # no lock: nothing to do
