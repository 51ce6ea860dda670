"""The tests' plugin (tests/helpers/plugin.py): which code's process starts count as this project's. A library's
own builds and probes (torch.compile's g++, ninja --version) never do, wherever the library is installed: a
virtual environment inside the clone or beside it with the same prefix included. Checked on live frames of code
compiled under those file names."""
import functools
import os
import sys

import pytest

from helpers import plugin

REPO = plugin.REPO
IN_CLONE_VENV = os.path.join(REPO, ".venv", "lib", "python3.11", "site-packages")
SIBLING_VENV = REPO + "-venv"


def frame_through(*filenames):
    """The innermost frame of a chain of calls through one function in each file, outermost first."""
    call = None
    for filename in reversed(filenames):
        namespace = {"sys": sys}
        exec(compile("def level(inner):\n    return inner() if inner else sys._getframe(0)\n", filename, "exec"),
             namespace)
        call = functools.partial(namespace["level"], call)
    return call()


@pytest.mark.parametrize("path, ours", [
    (os.path.join(REPO, "moe_plugin", "ops", "native.py"), True),
    (os.path.join(REPO, "tests", "core", "test_compile.py"), True),
    (os.path.join(REPO, "benchmarks", "bench_layer.py"), True),
    (os.path.join(IN_CLONE_VENV, "torch", "_inductor", "cpp_builder.py"), False),
    (os.path.join(REPO, ".venv", "lib", "python3.11", "dist-packages", "deepspeed", "ops", "op_builder.py"), False),
    (os.path.join(SIBLING_VENV, "lib", "python3.11", "site-packages", "torch", "utils", "cpp_extension.py"), False),
    (os.path.join(SIBLING_VENV, "bin", "tool.py"), False),     # shares the repository's path as a string prefix
    ("<string>", False),
])
def test_which_files_are_the_projects(path, ours):
    assert plugin.is_project_file(path) is ours
    assert plugin.asked_for_by_this_project(frame_through(path)) is ours


SUBPROCESS = os.path.join(plugin.STANDARD_LIBRARY, "subprocess.py")
SPAWN = os.path.join(plugin.LAUNCH_LIBRARIES[0], "spawn.py")


@pytest.mark.parametrize("chain, ours", [
    # whoever calls the standard library or torch's launchers asked for the process
    ((os.path.join(REPO, "tests", "helpers", "launch.py"), SUBPROCESS), True),
    ((os.path.join(REPO, "tests", "parallel", "test_a2a.py"), SPAWN, SUBPROCESS), True),
    # a library's own probe, called from a test: the library asked, whoever called it
    ((os.path.join(REPO, "tests", "core", "test_compile.py"),
      os.path.join(IN_CLONE_VENV, "torch", "_inductor", "cpp_builder.py"), SUBPROCESS), False),
    ((os.path.join(REPO, "tests", "core", "test_compile.py"),
      os.path.join(SIBLING_VENV, "lib", "python3.11", "site-packages", "torch", "_inductor", "cpp_builder.py"),
      SUBPROCESS), False),
    # a library installed inside the standard library's folder (a system or pyenv Python) is a library too
    ((os.path.join(REPO, "tests", "core", "test_compile.py"),
      os.path.join(plugin.STANDARD_LIBRARY, "site-packages", "ninja", "__init__.py"), SUBPROCESS), False),
])
def test_who_asked_for_a_process(chain, ours):
    assert plugin.asked_for_by_this_project(frame_through(*chain)) is ours
