"""The torch minimum: setup.py states the one moe_plugin checks at import, and the check refuses older torch."""
import ast
import re

import pytest
import torch

from moe_plugin import ops

from helpers.paths import REPO

SETUP = REPO / "setup.py"


def install_requires():
    for node in ast.walk(ast.parse(SETUP.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no install_requires")


def test_setup_states_the_minimum_checked_at_import():
    torch_requirements = [r for r in install_requires() if r.replace(" ", "").startswith("torch")]
    assert torch_requirements == [f"torch>={ops.TORCH_MINIMUM}"]


@pytest.mark.parametrize("version", ["2.10.1+cu128", "2.9.0", "1.13.1", "2.1.0"])
def test_older_torch_is_refused_naming_both_versions(version):
    with pytest.raises(ImportError, match=re.escape(f"torch>={ops.TORCH_MINIMUM}") + ".*" + re.escape(f"torch {version} is installed")):
        ops.require_torch(version)


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.11.0a0+git1234567", "2.13.0+cpu", "2.20.0", "3.0.0"])
def test_the_minimum_and_newer_are_accepted(version):
    ops.require_torch(version)


def test_the_installed_torch_passes():
    ops.require_torch(torch.__version__)
