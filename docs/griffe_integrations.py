"""Griffe extension: setup.py installs integrations/ as moe_plugin.integrations (package_dir), which griffe's
static finder does not follow; attach the folder under moe_plugin so that the API page can render it."""
from pathlib import Path

import griffe

INTEGRATIONS = Path(__file__).resolve().parents[1] / "integrations"


class AttachIntegrations(griffe.Extension):
    def on_package(self, *, pkg, loader, **kwargs):
        if pkg.name != "moe_plugin" or "integrations" in pkg.members:
            return
        integrations = loader.load(INTEGRATIONS, find_stubs_package=False)
        integrations.parent = pkg
        pkg.set_member("integrations", integrations)
