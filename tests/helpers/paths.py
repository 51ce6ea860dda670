"""Where things are, and scripts of the repository (examples, docs hooks) loaded as modules by their path."""
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def load_script(relative_path: str):
    """REPO/relative_path (a script, not part of a package) imported under its file name, once per process."""
    path = REPO / relative_path
    if path.stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    return sys.modules[path.stem]


def package_path(filename: str):
    """filename relative to the installed moe_plugin package (moe_plugin.__file__'s folder, or the integrations
    folder it installs), as "ops/grouped.py" or "integrations/deepspeed/hook.py"; None for any other file. Never by
    path text: a clone named moe_plugin holds torch's own files under .../moe_plugin/.venv/."""
    import moe_plugin
    import moe_plugin.integrations
    path = Path(filename).resolve()
    for root, prefix in ((Path(moe_plugin.integrations.__file__).resolve().parent, "integrations/"),
                         (Path(moe_plugin.__file__).resolve().parent, "")):
        if path.is_relative_to(root):
            return prefix + path.relative_to(root).as_posix()
    return None
