"""Installed as the top-level module moe_plugin_deepspeed_hook: when a program first imports `deepspeed`,
moe_plugin.integrations.deepspeed.enable() wraps deepspeed.initialize (see hook.py).

setup.py also installs moe_plugin_deepspeed_hook.pth. Its one line, run at every interpreter start unless
MOE_PLUGIN_DEEPSPEED_HOOK=0, puts at the head of sys.meta_path a stand-in of DeepSpeedImportHook (same class
name) built in place, which imports this module only when `deepspeed` is looked up: a program that never
imports deepspeed reads no file for the hook. Standard library only.
"""
import sys

__all__ = ["DeepSpeedImportHook", "find_spec", "install", "uninstall"]


class DeepSpeedImportHook:
    """A sys.meta_path finder that answers only for `deepspeed` (see find_spec)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        return find_spec(name, path, target) if name == "deepspeed" else None


def find_spec(name, path=None, target=None):
    """The spec the other finders give, with a loader that runs enable() right after deepspeed's __init__ and
    takes the hook away. Looking deepspeed up without importing it (importlib.util.find_spec) leaves it."""
    for finder in sys.meta_path:
        if type(finder).__name__ == DeepSpeedImportHook.__name__ or not hasattr(finder, "find_spec"):
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
            enable = _hook_enable()
        except Exception as error:
            raise ImportError(f"moe_plugin's DeepSpeed hook could not load moe_plugin.integrations.deepspeed "
                              f"({error}); set MOE_PLUGIN_DEEPSPEED_HOOK=0 to start DeepSpeed without it") from error
        enable()
    return exec_module


def _hook_enable():
    from moe_plugin.integrations.deepspeed.hook import enable   # this file runs at every interpreter start: stdlib only
    return enable


def install() -> None:
    """Register the finder (once), or enable() now if deepspeed is already imported."""
    if "deepspeed" in sys.modules:
        _hook_enable()()
    elif not any(type(finder).__name__ == DeepSpeedImportHook.__name__ for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != DeepSpeedImportHook.__name__]
