"""Run at interpreter start by moe_plugin_deepspeed_hook.pth: when a program first imports `deepspeed`,
moe_plugin.integrations.deepspeed.enable() wraps deepspeed.initialize (see hook.py).

setup.py installs this file as the top-level module moe_plugin_deepspeed_hook next to the .pth, whose one
line imports it unless MOE_PLUGIN_DEEPSPEED_HOOK=0. Standard library only, and nothing runs until `deepspeed`
is imported: a program that never imports it pays for one small import and one finder that answers None.
"""
import sys

__all__ = ["DeepSpeedImportHook", "install"]


class DeepSpeedImportHook:
    """A sys.meta_path finder that answers only for `deepspeed`, with the spec the other finders give: its loader
    runs enable() right after deepspeed's __init__ has run, and takes the hook away. (Looking deepspeed up, as
    importlib.util.find_spec does, leaves the hook in place.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader.exec_module = _enable_after(spec.loader)   # this loader object only
                return spec
        return None


def _enable_after(loader):
    def exec_module(module):
        del loader.exec_module
        uninstall()
        loader.exec_module(module)
        try:
            from moe_plugin.integrations.deepspeed.hook import enable
        except Exception as error:
            raise ImportError(f"moe_plugin's DeepSpeed hook could not load moe_plugin.integrations.deepspeed "
                              f"({error}); set MOE_PLUGIN_DEEPSPEED_HOOK=0 to start DeepSpeed without it") from error
        enable()
    return exec_module


def install() -> None:
    """Register the finder (once), unless deepspeed is already imported (then enable() directly)."""
    if "deepspeed" in sys.modules:
        from moe_plugin.integrations.deepspeed.hook import enable
        enable()
    elif not any(isinstance(finder, DeepSpeedImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook())


def uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, DeepSpeedImportHook)]
