"""Moved to tests/helpers/ (reference, compare, routes, host_syncs, launch); this name stays until every test
imports those."""
from helpers.compare import relative_error  # noqa: F401
from helpers.host_syncs import HOST_SYNCING_OPS, HostSyncs  # noqa: F401
from helpers.launch import torchrun_train  # noqa: F401
from helpers.reference import assert_matches_reference, fast, make_layer, outputs_and_grads, reference  # noqa: F401
from helpers.routes import random_slots  # noqa: F401
