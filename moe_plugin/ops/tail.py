"""Whether the rows past the last group / kept choice may stay as they come: a thread's switch that grouped_mm,
scatter_rows and the Triton grouped GEMMs read (its own file: those kernels' modules read it without importing the
kernel choice, which imports them)."""
from __future__ import annotations

import contextlib
import threading

_TAIL = threading.local()


@contextlib.contextmanager
def tail_rows_unread():
    """Inside: grouped_mm and scatter_rows leave the rows past the last group / kept choice as they come (not
    zeroed), for a caller none of whose consumers reads them (the fused layer: every grouped GEMM reads only its
    groups' rows, gather_sum only the kept ones); in a dropless step there are none. Saves a launch per call."""
    before, _TAIL.unread = tail_unread(), True
    try:
        yield
    finally:
        _TAIL.unread = before


def tail_unread() -> bool:
    return getattr(_TAIL, "unread", False)
