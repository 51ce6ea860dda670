"""A wheel of this project holds what the package reads at run time: the C++ sources that ops/native.py builds on
first use, the example experiments (`moe-plugin train NAME`), the DeepSpeed hook's .pth and module, the fairseq
adapter's README. Installed from the wheel (outside the checkout), the package finds its sources and configs in
itself. The wheel is built from a copy of the sources setup.py reads, so the checkout gets no build/ or egg-info."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from moe_plugin.ops import native

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(path.name for path in (REPO / "configs" / "experiments").glob("*.yaml"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "source"
    for name in ("moe_plugin", "integrations", "csrc", "configs"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(folder / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    return next((folder / "dist").glob("moe_plugin-*.whl"))


def test_the_wheel_holds_what_the_package_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"moe_plugin/csrc/{name}" for name in native.SOURCES} | {
        f"moe_plugin/configs/experiments/{name}" for name in EXPERIMENTS} | {
        "moe_plugin_deepspeed_hook.pth", "moe_plugin_deepspeed_hook.py",
        "moe_plugin/integrations/fairseq_moe/README.md", "moe_plugin/integrations/deepspeed/__init__.py",
        "moe_plugin/ops/native.py"}
    assert len(EXPERIMENTS) >= 2 and wanted <= names, sorted(wanted - names)


def test_an_installed_wheel_finds_its_sources_and_configs(wheel, tmp_path):
    """Installed into a folder of its own (first on the path): csrc/ and the experiments come from there."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # in tmp_path: python -c and -m put the working directory first on the path, and in the checkout that is the
    # checkout's moe_plugin
    run = dict(check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(target)},
               cwd=tmp_path, timeout=120)
    found = subprocess.run(
        [sys.executable, "-c", "import moe_plugin; from moe_plugin.ops import native; from moe_plugin.train.config import experiments;"
         "print(moe_plugin.__file__); print(native.csrc_dir()); print(experiments())"], **run).stdout.split()
    assert found == [str(target / "moe_plugin" / "__init__.py"), str(target / "moe_plugin" / "csrc"),
                     str(target / "moe_plugin" / "configs" / "experiments")]
    for name in native.SOURCES:
        assert (target / "moe_plugin" / "csrc" / name).read_bytes() == (REPO / "csrc" / name).read_bytes()
    printed = subprocess.run([sys.executable, "-m", "moe_plugin.cli", "train", "fine_grained", "--print-config"],
                             **run).stdout
    assert "num_experts: 32" in printed and "router: sigmoid" in printed     # fine_grained.yaml's, not the defaults
