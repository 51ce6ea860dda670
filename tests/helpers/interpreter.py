"""The CUDA code path's tests on CPU under the Triton interpreter.

triton reads TRITON_INTERPRET when it is imported, so one process runs either the interpreter or the compiler. The
tests marked `interpreter` run again in a child pytest started with TRITON_INTERPRET=1: one child per session for
every test file collected that has such tests (a start of Python, torch, triton and pytest costs seconds; one child
for all pytest-xdist workers too), and each file's test_interpreter_run reports its own file's part of its run."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest
from filelock import FileLock   # torch's own dependency

from helpers.paths import REPO

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
NO_TRITON = "triton is not installed (pip install triton): the CUDA path cannot run on CPU"
in_parent = pytest.mark.skipif(INTERPRET, reason="this is the interpreter run")
_RESULT = re.compile(r"^(PASSED|FAILED|ERROR) (\S+?\.py)(::\S*)?")


def in_child(test):
    """A test that runs only in the interpreter child (the compiled kernels have their own tests on CUDA)."""
    skip = pytest.mark.skipif(not INTERPRET, reason="runs under the Triton interpreter, in the child process that "
                                                    "this file's test_interpreter_run starts")
    return pytest.mark.interpreter(skip(test))


def check_child_run(request) -> None:
    """Fail unless this file's interpreter tests all passed in the session's child run."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip(reason=NO_TRITON)
    outcomes, output = _session_run(request)
    mine = outcomes.get(os.path.relpath(request.path, REPO), {})
    failed = mine.get("FAILED", []) + mine.get("ERROR", [])
    assert not failed and mine.get("PASSED"), f"under TRITON_INTERPRET=1, {failed or 'nothing passed'}:\n{output}"
    print(f"{len(mine['PASSED'])} passed under the interpreter")


def _session_run(request) -> tuple:
    """The child run of the files of every test_interpreter_run collected, started by the first to ask; under
    pytest-xdist its workers share it (the first runs it holding a lock in their common temporary folder)."""
    root = request.getfixturevalue("tmp_path_factory").getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent
    path = root / "triton_interpreter_run.json"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            files = sorted({os.path.relpath(item.path, REPO) for item in request.session.items
                            if item.originalname == request.node.originalname})
            path.write_text(json.dumps(_run_child(files)))
        return json.loads(path.read_text())


def _run_child(files) -> tuple:
    """({file: {"PASSED" | "FAILED" | "ERROR": [test ids]}}, the child's output's tail)."""
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-m", "interpreter", *files]
    child = subprocess.run(command, cwd=REPO, env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"),
                           capture_output=True, text=True, timeout=900)
    outcomes = defaultdict(lambda: defaultdict(list))
    for line in child.stdout.splitlines():
        match = _RESULT.match(line)
        if match:
            outcomes[match.group(2)][match.group(1)].append(match.group(2) + (match.group(3) or ""))
    return outcomes, (failures(child.stdout) + child.stderr)[-8000:]


def failures(stdout: str) -> str:
    """The child's ERRORS and FAILURES sections (their tracebacks), without -rA's PASSES section of captured
    output and its summary list, which would push them out of the kept tail."""
    body = stdout.split("short test summary info")[0]
    body = re.split(r"^=+ PASSES =+$", body, flags=re.M)[0]
    start = re.search(r"^=+ (ERRORS|FAILURES) =+$", body, flags=re.M)
    return body[start.start():] if start else body
