"""The "moe" section wherever DeepSpeed starts: enable() routes every deepspeed.initialize call whose config has
a "moe" section through moe_plugin.integrations.deepspeed.initialize.

HF Trainer, Accelerate, Lightning and plain scripts call deepspeed.initialize, and DeepSpeed ignores unknown
top-level keys. Once enable() has run (the moe_plugin_deepspeed_hook.pth that moe_plugin installs runs it when
`deepspeed` is first imported; see startup.py), a config with a "moe" section is swapped and validated as
moe_plugin's initialize does, or fails with its error; a config without one reaches DeepSpeed untouched.
Calls made from moe_plugin's own modules (its initialize calls deepspeed.initialize once the section is applied)
go straight to DeepSpeed.

Standard library only at the top: `deepspeed` is imported when enable() runs, moe_plugin's adapter when a
section is found.
"""
import functools
import inspect
import sys

__all__ = ["enable", "disable", "is_enabled", "near_moe_keys"]

_ORIGINAL = "_moe_plugin_original"   # attribute of the wrapper: the deepspeed.initialize it wraps


def enable() -> None:
    """Wrap deepspeed.initialize so that a "moe" section in its config takes effect, and a model already holding
    moe_plugin's layers goes through moe_plugin's initialize (ZeRO-3 placement, MoE optimizer groups); make
    DeepSpeed's zero_to_fp32 functions consolidate ZeRO-3 checkpoints at ep_size > 1 (consolidate.py). Idempotent."""
    import deepspeed
    if is_enabled():
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("moe_plugin."):
            return original(*args, **kwargs)
        if not (_has_moe_section(original, args, kwargs) or _holds_moe_plugin_layers(original, args, kwargs)):
            return original(*args, **kwargs)
        return _adapter().initialize(*args, **kwargs)

    setattr(initialize, _ORIGINAL, original)
    deepspeed.initialize = initialize
    _adapter().consolidate.patch_zero_to_fp32()


def disable() -> None:
    """Undo enable(): deepspeed.initialize and zero_to_fp32 are DeepSpeed's own again."""
    import deepspeed
    if is_enabled():
        deepspeed.initialize = getattr(deepspeed.initialize, _ORIGINAL)
        _adapter().consolidate.unpatch_zero_to_fp32()


def _adapter():
    """moe_plugin's DeepSpeed adapter (its consolidate module loaded too), imported on use only."""
    import moe_plugin.integrations.deepspeed.consolidate   # noqa: F401  (this file loads with deepspeed: stdlib only)
    return sys.modules["moe_plugin.integrations.deepspeed"]


def is_enabled() -> bool:
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and hasattr(deepspeed.initialize, _ORIGINAL)


def _holds_moe_plugin_layers(original, args: tuple, kwargs: dict) -> bool:
    """Whether the model of this call was swapped beforehand (swap_moe_blocks, moe_plugin's MoE): DeepSpeed alone
    refuses such a model at ZeRO stage 3 and, at stages 1/2, a client optimizer without DeepSpeed's MoE groups."""
    MoELayer = _adapter().MoELayer
    try:
        model = inspect.signature(original).bind(*args, **kwargs).arguments.get("model")
    except TypeError:
        return False
    return model is not None and any(isinstance(m, MoELayer) for m in model.modules())


def _has_moe_section(original, args: tuple, kwargs: dict) -> bool:
    """Whether the config this deepspeed.initialize call reads (config, config_params or args.deepspeed_config, as
    DeepSpeed looks them up) has a "moe" key, or a near miss of it (then moe_plugin's initialize refuses it). False
    where DeepSpeed itself will refuse the call."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    try:
        given = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError:
        return False
    cli_args = given.get("args")
    config = next((given[key] for key in ("config", "config_params") if given.get(key) is not None), None)
    if config is None:
        config = getattr(cli_args, "deepspeed_config", None) or getattr(cli_args, "deepscale_config", None)
    try:
        loaded = load_ds_config(config) if config is not None else {}
    except ValueError:
        return False
    return "moe" in loaded or bool(near_moe_keys(loaded))


def near_moe_keys(config) -> list:
    """Top-level keys of a DeepSpeed config that look meant as "moe" ("MoE", "moe_config", "moe-section",
    "mixture_of_experts"), which DeepSpeed would ignore without a word: read_moe_section refuses them."""
    def near(key):
        flat = key.lower().replace("-", "_").replace(" ", "")
        return key != "moe" and (flat.startswith("moe") or flat.replace("_", "") == "mixtureofexperts")
    return [key for key in config if isinstance(key, str) and near(key)] if isinstance(config, dict) else []
