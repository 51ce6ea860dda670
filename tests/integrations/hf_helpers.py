"""Moved to tests/helpers/hf.py (import helpers.hf); this name stays until every test imports that."""
from helpers.compare import assert_close_rel, relative_error as max_rel_err  # noqa: F401
from helpers.hf import *  # noqa: F401,F403
from helpers.hf import IMPORT_ERROR, hf_key, hf_moe, transformers, transformers_available  # noqa: F401
