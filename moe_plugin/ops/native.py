"""Builds (once, then cached) and loads the C++ CPU kernels in csrc/ with torch's JIT extension loader.

The build lands in torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions),
in a folder named by a hash of the sources and flags; later processes import the library from there directly
(no build lock, no ninja run), in well under a second.
"""
from __future__ import annotations

import functools
import hashlib
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Optional, Tuple

SOURCES = ("routing_cpu.cpp", "swiglu_cpu.h")     # the build folder is named by a hash of all of them
MODULE_NAME = "moe_plugin_routing_cpu"
CFLAGS = ("-O3", "-fopenmp")
STALE_LOCK_SECONDS = 600    # a build takes about a minute; a lock this old belongs to a killed process
# a source checkout (pip install -e .) keeps csrc/ and configs/ at the repository's top; a wheel or sdist install
# carries copies inside the package (setup.py installs them as moe_plugin/csrc and moe_plugin/configs)
PACKAGE = Path(__file__).resolve().parent.parent


def shipped(folder: str) -> Path:
    """The folder (csrc or configs) inside the installed package, else the checkout's; the package's copy when
    neither exists, so that a message names where it was looked for."""
    installed, checkout = PACKAGE / folder, PACKAGE.parent / folder
    return checkout if checkout.is_dir() and not installed.is_dir() else installed


def csrc_dir() -> Path:
    return shipped("csrc")


@functools.lru_cache(maxsize=None)
def load() -> Tuple[Optional[ModuleType], str]:
    """(module, why) where module is None when the kernels cannot be built here; why says which."""
    sources = [csrc_dir() / name for name in SOURCES]
    missing = [str(path) for path in sources if not path.is_file()]
    if missing:
        return None, (f"C++ sources not found ({', '.join(missing)}); this install of moe_plugin lacks them: "
                      f"reinstall it from a source checkout (`pip install .`, or `pip install -e .` to edit it), "
                      f"which ships csrc/ in the package")
    if shutil.which("ninja") is None and not _ninja_module():
        return None, "ninja is not installed (`pip install ninja`); torch needs it to build C++ extensions"
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler (c++ / g++) on PATH"
    from torch.utils import cpp_extension
    # one build folder per source version and flags: checkouts of different versions never rebuild over each other
    digest = hashlib.sha1(b"".join(path.read_bytes() for path in sources) + " ".join(CFLAGS).encode())
    name = f"{MODULE_NAME}_{digest.hexdigest()[:10]}"
    built = f"built from csrc/ with {compiler}"
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, False))
        library = build_dir / f"{name}.so"
        if library.is_file():   # built before: import it without torch's build lock and ninja run
            try:
                return cpp_extension._import_module_from_library(name, str(build_dir), True), built
            except ImportError:   # a build killed while linking: build again (unless one is running now)
                if not (build_dir / "lock").exists():
                    library.unlink()
        _clear_stale_lock(build_dir / "lock")
        print("moe_plugin: building the native CPU kernels (first use only, about a minute)...",
              file=sys.stderr, flush=True)
        module = cpp_extension.load(name=name, sources=[str(path) for path in sources if path.suffix == ".cpp"],
                                    extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp", "-ldl"], verbose=False)
    except Exception as error:  # any build or load failure means: use the torch path and say why
        detail = str(error).strip().splitlines()
        return None, f"building csrc/ failed: {detail[-1] if detail else type(error).__name__}"
    return module, built


def _clear_stale_lock(lock: Path) -> None:
    """torch's build lock is a file that a killed build leaves behind, and every later build waits on it
    forever: remove it once it is far older than a build takes."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        print(f"moe_plugin: removing a stale build lock ({lock}, {age / 60:.0f} min old)", file=sys.stderr, flush=True)
        lock.unlink(missing_ok=True)


def _ninja_module() -> bool:
    try:
        import ninja  # noqa: F401  (the PyPI package puts the binary next to the interpreter)
    except ImportError:
        return False
    return True
