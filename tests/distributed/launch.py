"""Moved to tests/helpers/launch.py (import helpers.launch); this name stays until every test imports that."""
from helpers.launch import _free_port, _worker, run_workers  # noqa: F401
