"""Builds (once, then cached) and loads the C++ CPU kernels in csrc/ with torch's JIT extension loader.

The build lands in torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions),
in a folder named by a hash of the sources, so later processes load it in well under a second.
"""
from __future__ import annotations

import functools
import hashlib
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional, Tuple

SOURCES = ("routing_cpu.cpp", "swiglu_cpu.h")     # the build folder is named by a hash of all of them
MODULE_NAME = "moe_plugin_routing_cpu"


def csrc_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "csrc"


@functools.lru_cache(maxsize=None)
def load() -> Tuple[Optional[ModuleType], str]:
    """(module, why) where module is None when the kernels cannot be built here; why says which."""
    sources = [csrc_dir() / name for name in SOURCES]
    missing = [str(path) for path in sources if not path.is_file()]
    if missing:
        return None, (f"C++ sources not found ({', '.join(missing)}); the native kernels need a source "
                      f"checkout installed with `pip install -e .`")
    if shutil.which("ninja") is None and not _ninja_module():
        return None, "ninja is not installed (`pip install ninja`); torch needs it to build C++ extensions"
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler (c++ / g++) on PATH"
    from torch.utils import cpp_extension
    # one build folder per source version: checkouts of different versions never rebuild over each other
    name = f"{MODULE_NAME}_{hashlib.sha1(b''.join(path.read_bytes() for path in sources)).hexdigest()[:10]}"
    try:
        if not (Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so").is_file():
            print("moe_plugin: building the native CPU kernels (first use only, about a minute)...",
                  file=sys.stderr, flush=True)
        module = cpp_extension.load(name=name, sources=[str(path) for path in sources if path.suffix == ".cpp"],
                                    extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # any build or load failure means: use the torch path and say why
        detail = str(error).strip().splitlines()
        return None, f"building csrc/ failed: {detail[-1] if detail else type(error).__name__}"
    return module, f"built from csrc/ with {compiler}"


def _ninja_module() -> bool:
    try:
        import ninja  # noqa: F401  (the PyPI package puts the binary next to the interpreter)
    except ImportError:
        return False
    return True
