"""Imported once by the forkserver that helpers.launch's workers fork from: the hosts the DeepSpeed and HF tests'
ranks use, where installed. Each rank would import them again otherwise (2-3 s of CPU each, over a hundred ranks
in the suite). Nothing here reads the environment a test sets for its ranks: those modules read it when called."""
import importlib.util
import sys


def _import_hosts():
    if importlib.util.find_spec("transformers") is not None:
        import moe_plugin.integrations.transformers  # noqa: F401  (first: hides an unloadable torchaudio)
        from transformers import MixtralForCausalLM, Trainer  # noqa: F401  (the model the ranks build most)
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401


try:
    _import_hosts()
except Exception as error:  # only a head start: the ranks import for themselves and fail there, saying why
    print(f"helpers.preload: the forkserver did not import the hosts ({error!r})", file=sys.stderr)
