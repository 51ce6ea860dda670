"""Keep an unloadable torchaudio from breaking transformers' model imports.

fairseq (the `fairseq` extra) pulls torchaudio 2.11, whose native library does not load against
torch 2.13. transformers decides that torchaudio is available when `importlib.util.find_spec`
finds it, and then imports it from `transformers.audio_utils`, which every modeling module
reaches: `from transformers.models.mixtral import modeling_mixtral` raises OSError.
find_spec returns None for a name whose sys.modules entry is None, and `import torchaudio` then
raises ImportError, which transformers and fairseq both take as "not installed".
"""
from __future__ import annotations

import importlib.util
import sys


def hide_unloadable_torchaudio() -> bool:
    """If torchaudio is installed but fails to import, make Python treat it as absent. True if hidden.

    Must run before transformers first checks for torchaudio (it caches the answer).
    """
    if "torchaudio" in sys.modules or importlib.util.find_spec("torchaudio") is None:
        return False
    try:
        import torchaudio  # noqa: F401
    except (OSError, ImportError, RuntimeError):
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]
        sys.modules["torchaudio"] = None
        return True
    return False
