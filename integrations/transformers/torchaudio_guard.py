"""Keep an unloadable torchaudio from breaking transformers' model imports.

fairseq (the `fairseq` extra) pulls torchaudio 2.11, whose native library does not load against
torch 2.13. transformers decides that torchaudio is available when `importlib.util.find_spec`
finds it, and then imports it from `transformers.audio_utils`, which every modeling module
reaches: `from transformers.models.mixtral import modeling_mixtral` raises OSError.
find_spec returns None for a name whose sys.modules entry is None, and `import torchaudio` then
raises ImportError, which transformers and fairseq both take as "not installed".

transformers caches its answer (`is_torchaudio_available`, an lru_cache, asked already by `import transformers`):
when transformers was imported first, hiding torchaudio also clears that cache, so that its model modules skip
torchaudio instead of failing to import it.
"""
from __future__ import annotations

import importlib.util
import sys

CACHED_CHECKS = ("is_torchaudio_available", "is_speech_available")   # transformers.utils.import_utils', cached


def hide_unloadable_torchaudio() -> bool:
    """If torchaudio is installed but fails to import, make Python treat it as absent. True if hidden.

    Works whether or not transformers was imported before (it forgets transformers' cached answer); it must run
    before any transformers model module is imported (those import torchaudio).
    """
    if "torchaudio" in sys.modules or importlib.util.find_spec("torchaudio") is None:
        return False
    try:
        import torchaudio  # noqa: F401
    except (OSError, ImportError, RuntimeError):
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]
        sys.modules["torchaudio"] = None
        _forget_transformers_answer()
        return True
    return False


def _forget_transformers_answer() -> None:
    """Clear transformers' cached "torchaudio is available" (if transformers is imported): asked again, it is no."""
    import_utils = sys.modules.get("transformers.utils.import_utils")
    for name in CACHED_CHECKS:
        clear = getattr(getattr(import_utils, name, None), "cache_clear", None)
        if clear is not None:
            clear()
