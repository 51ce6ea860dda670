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
