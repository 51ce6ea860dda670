"""The tests' pytest plugin (loaded by tests/conftest.py): a fresh seed per test, the spawns marker set on every
test that starts processes, and a guard that fails a test starting one without it."""
import importlib.util
import inspect
import multiprocessing.process
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# names whose use in a test, its fixtures or the tests' own helpers they call means "starts processes"
LAUNCHERS = frozenset({"subprocess", "run_workers", "spawn", "start_processes", "Process", "Popen"})
REPO = os.path.dirname(TESTS)
# code a process start passes through on its way from whoever asked for it: the standard library (not the
# libraries installed inside it, as under a system or pyenv Python), torch's launchers, this file
STANDARD_LIBRARY = os.path.dirname(os.__file__)
LAUNCH_LIBRARIES = (os.path.join(os.path.dirname(torch.__file__), "multiprocessing"),
                    os.path.join(os.path.dirname(torch.__file__), "distributed"), os.path.abspath(__file__))
# folders that hold installed libraries, wherever they are (a virtual environment inside the clone included)
LIBRARY_FOLDERS = frozenset({"site-packages", "dist-packages"})

# JIT-built C++ ops (ours, DeepSpeed's CPU shm comm) are cached per environment: two environments sharing
# ~/.cache/torch_extensions rebuild each other's ops, and a build killed half-way leaves a lock on which every
# later build of that op waits forever (seen: all DeepSpeed tests hung). Spawned workers inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
# the scripts the tests start (torchrun'd workers in helpers/workers, commands) import helpers as the tests do:
# tests/ on their path too, as pytest.ini's pythonpath puts it on this process's
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
# one thread per process unless asked otherwise: the multi-process tests share 2 cores, where torch's default of
# one thread per core in every process collapses (a step up to 6x slower); spawned workers inherit it
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(optionalhook=True)   # pytest-xdist's hook: no error where it is not installed
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (each worker's multi-process tests start 2-4 ranks of their own)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()   # not on macOS
    return max(1, min(4, cores or 1))


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A fresh seed per test, printed so a failure can be replayed with MOE_TEST_SEED=<seed>."""
    seed = int(os.environ.get("MOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    print(f"{request.node.nodeid}: MOE_TEST_SEED={seed}")
    return seed


@pytest.fixture(scope="session")
def deepspeed_comm_op_built():
    """DeepSpeed builds its CPU shm comm op (JIT) in every process that starts its comm. Built here once, in a
    process of its own that no test's timeout stops, so a worker killed by a timeout never dies in the build.
    The integration folders' conftest.py files ask for it before their tests."""
    if importlib.util.find_spec("deepspeed") is None:
        return
    from torch.utils.cpp_extension import _get_build_directory
    from moe_plugin.ops.native import _clear_stale_lock
    _clear_stale_lock(Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock")
    subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                   check=True, timeout=1200, capture_output=True)


def _names(code: types.CodeType) -> set:
    """Global and attribute names a code object and its nested functions use."""
    names, stack = set(), [code]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return names


def _starts_processes(functions) -> bool:
    """Whether these functions, or functions of tests/ they reach by name, use a launcher."""
    todo, seen = list(functions), set()
    while todo:
        function = inspect.unwrap(todo.pop())
        code = getattr(function, "__code__", None)
        if code is None or code in seen or not is_inside(code.co_filename, TESTS):
            continue
        seen.add(code)
        names = _names(code)
        if names & LAUNCHERS:
            return True
        todo += [value for value in map(function.__globals__.get, names) if inspect.isfunction(value)]
    return False


def is_inside(path: str, folder: str) -> bool:
    """Whether path is folder or lies in it, by whole path components (/repo-venv/x is not inside /repo)."""
    return os.path.isabs(path) and os.path.commonpath([path, folder]) == folder


def is_library(path: str) -> bool:
    """Whether path lies in a folder of installed libraries (site-packages, dist-packages), wherever that is."""
    return not LIBRARY_FOLDERS.isdisjoint(Path(path).parts)


def is_project_file(path: str) -> bool:
    """Whether code in path is this repository's own (a test, its helpers, the package, a benchmark): inside the
    repository and not a library installed there (a virtual environment inside the clone)."""
    return is_inside(path, REPO) and not is_library(path)


def asked_for_by_this_project(frame: types.FrameType) -> bool:
    """Whether the code that starts a process (frame: the call of the launcher) is this repository's, not a
    library's own builds and probes (torch.compile's C++ compiler and its load check, JIT-built ops, g++ and ninja
    --version, find_library), which run whenever torch's caches are cold or at every start."""
    while frame is not None:
        path = frame.f_code.co_filename
        passes_through = any(is_inside(path, folder) for folder in LAUNCH_LIBRARIES) or (
            is_inside(path, STANDARD_LIBRARY) and not is_library(path))
        if not passes_through:
            return is_project_file(path)
        frame = frame.f_back
    return False


def pytest_collection_modifyitems(items):
    """Mark spawns on every test that starts processes (its body, its fixtures, or the helpers they call), so
    that `pytest -m "not spawns"` is the in-process inner loop. process_guard catches what this misses.
    Session fixtures (one-time builds shared by every test) and this file's own fixtures do not count."""
    for item in items:
        fixtures = [fixture.func for defs in item._fixtureinfo.name2fixturedefs.values() for fixture in defs
                    if fixture.scope != "session" and fixture.func.__code__.co_filename != __file__]
        if item.get_closest_marker("spawns") is None and _starts_processes([item.function] + fixtures):
            item.add_marker(pytest.mark.spawns)


@pytest.fixture(autouse=True)
def process_guard(request, monkeypatch):
    """A test that starts a process without the spawns marker fails, naming what it started: the marker (set by
    pytest_collection_modifyitems) must be right for `-m "not spawns"` to mean what it says."""
    if request.node.get_closest_marker("spawns") is not None:
        yield
        return
    started = []

    def recording(original):
        def record(self, *args, **kwargs):
            if asked_for_by_this_project(sys._getframe(1)):   # the launcher's caller
                started.append(f"{type(self).__name__} {args[0] if args else kwargs.get('args', '')}"[:200])
            return original(self, *args, **kwargs)
        return record
    monkeypatch.setattr(subprocess.Popen, "__init__", recording(subprocess.Popen.__init__))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        recording(multiprocessing.process.BaseProcess.start))
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} started a process ({started[0]}) but is not marked spawns: mark it "
                    f"@pytest.mark.spawns, or add the launcher it calls to LAUNCHERS in tests/helpers/plugin.py")
