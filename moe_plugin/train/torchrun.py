"""`python -m moe_plugin.train.torchrun ARGS`: torchrun (torch.distributed.run, the same arguments) as `moe-plugin
train --nproc-per-node N` starts it, ending the way `moe-plugin train` ends on one process.

When the ranks stop on purpose, each has said why in one line (rank 0: preempted, with the checkpoint and how to
resume; an error found once the processes are known; train.nonfinite), and exits with the command's status (75, 2,
3). torchrun would then add a ChildFailedError traceback, or, when the signal reached torchrun too, a
SignalException traceback; here it exits with the ranks' status instead, silently. Any other failure (a crash,
a rank killed) keeps torchrun's own report.
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import Dict, List, Optional

from .faults import NONFINITE_EXIT_CODE, PREEMPTED_EXIT_CODE

SAID = (PREEMPTED_EXIT_CODE, 2, NONFINITE_EXIT_CODE)   # the statuses whose rank printed its one line


def _record_exit_codes(codes: Dict[int, Optional[int]]) -> None:
    """After torchrun's agent shuts its workers down (on a signal), keep each local rank's exit status in codes."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    shutdown = LocalElasticAgent._shutdown

    def recording(self, *args, **kwargs):
        shutdown(self, *args, **kwargs)
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}
        for local_rank, handler in handlers.items():
            codes[local_rank] = handler.proc.poll()
    LocalElasticAgent._shutdown = recording


def _quiet(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.CRITICAL or not record.name.startswith(TORCHRUN_LOGGERS)


TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


def _quiet_torchrun_logs() -> None:
    """torchrun's own log lines (a worker failed, closing signals sent, ...) left out: the ranks say what happened,
    and a failure they did not report raises torchrun's ChildFailedError with its table of failures. A second
    signal that arrives while torchrun logs the first leaves no "Logging error" trace either."""
    logging.raiseExceptions = False
    loggers = [logging.getLogger()] + [logger for name, logger in logging.root.manager.loggerDict.items()
                                       if name.startswith("torch") and isinstance(logger, logging.Logger)]
    for logger in loggers:       # torch's logging gives torch and torch.distributed handlers of their own
        for handler in logger.handlers:
            handler.addFilter(_quiet)


def status(codes: List[Optional[int]], first: Optional[int] = None) -> Optional[int]:
    """The status to exit with when the ranks stopped on purpose, each saying why, else None. first: the status of
    the rank that failed first (torchrun then ends the others with SIGTERM, or SIGKILL after its timeout)."""
    failed = [code for code in codes if code != 0]
    ended = (-signal.SIGTERM, -signal.SIGKILL) if first in SAID else ()
    if failed and all(code in SAID or code in ended for code in failed):
        said = [code for code in failed if code in SAID]
        return PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in said else first if first in SAID else max(said)
    return None


def main(argv: List[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    codes: Dict[int, Optional[int]] = {}
    _record_exit_codes(codes)
    _quiet_torchrun_logs()
    try:
        run(parse_args(argv))
    except ChildFailedError as error:
        _, root = error.get_first_failure()
        code = status([failure.exitcode for failure in error.failures.values()], root.exitcode)
        if code is None:
            raise
        return code
    except SignalException as error:
        code = status(list(codes.values()))
        if code is None:
            print(f"moe-plugin train: torchrun got {error.sigval.name} and stopped the ranks before they saved "
                  f"(exit statuses {sorted(codes.values(), key=str) or 'unknown'}); the newest whole checkpoint, if "
                  f"any, resumes with train.resume=auto", file=sys.stderr)
            return 128 + int(error.sigval)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
