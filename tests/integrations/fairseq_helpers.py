"""Moved to tests/helpers/fairseq.py (import helpers.fairseq); this name stays until every test imports that."""
from helpers.fairseq import *  # noqa: F401,F403
