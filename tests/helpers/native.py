"""The native CPU kernels (csrc/) for the tests that call them directly."""
import shutil

import pytest

from moe_plugin.ops import native


def native_kernels():
    """The built module; a skip where no compiler or ninja is here, a failure where they are and it did not load."""
    module, why = native.load()
    if module is None:
        if shutil.which("g++") and (shutil.which("ninja") or native._ninja_module()):
            pytest.fail(f"a compiler and ninja are here but the native kernels did not load: {why}")
        pytest.skip(reason=f"native kernels unavailable here: {why}")
    return module
