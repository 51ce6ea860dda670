"""Moved to tests/helpers/init_checks.py (import helpers.init_checks); this name stays until every test imports
that."""
from helpers.init_checks import assert_normal, assert_uniform  # noqa: F401
