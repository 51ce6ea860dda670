"""Files shipped beside the code: the C++ sources (csrc/) and the example configs (configs/). A source checkout
(`pip install -e .`) reads them at the repository's top; a wheel or sdist install carries copies inside the package
(setup.py installs csrc/ as moe_plugin/csrc and configs/ as moe_plugin/configs)."""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def shipped(folder: str) -> Path:
    """The folder (csrc or configs) inside the installed package, else the checkout's; the package's copy when
    neither exists, so that a message names where it was looked for."""
    installed, checkout = PACKAGE / folder, PACKAGE.parent / folder
    return checkout if checkout.is_dir() and not installed.is_dir() else installed


def experiments() -> Path:
    """The example experiment configs: `moe-plugin train NAME` runs experiments()/NAME.yaml."""
    return shipped("configs") / "experiments"
