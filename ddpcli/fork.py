"""Workers forked from the launcher instead of started as new interpreters.

A new interpreter imports torch again in every worker: seconds of CPU per rank, paid
again on every restart, and on a machine with few cores the ranks' imports queue behind
each other. A forked worker finds torch and ddpcli already imported by the launcher.

Forking is safe only while the launcher has not started CUDA or run a parallel (OpenMP)
region, which a launcher never does; GPU jobs still start fresh interpreters, since CUDA
cannot be used in a forked child of a process that may later touch it.

torch.distributed.elastic runs a function (instead of a program) through its
MultiprocessContext; this module adapts that path to behave as the program path does:
each worker in a session of its own, with Python's default signal handlers, and every
failed rank reported, not only the first.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Iterator

# The signals elastic's agent catches (to pass on) and a forked child would inherit.
_INHERITED_HANDLERS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def forks_workers(uses_gpus: bool) -> bool:
    """Whether a job's workers are forked: CPU jobs on Linux. (macOS's system frameworks
    are not safe to use in a forked child; Windows cannot fork.)"""
    return not uses_gpus and sys.platform.startswith("linux")


def start_forked_worker(module: str, *argv: str) -> None:
    """A worker's entry point: `python -m MODULE *ARGV`, in a child forked by the agent."""
    # Like the agent's program path: the terminal's Ctrl-C reaches the agent alone, which
    # passes it on; the worker does not get it twice.
    with contextlib.suppress(OSError):
        os.setsid()
    for signum in _INHERITED_HANDLERS:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    name_process(f"ddpcli rank {os.environ.get('RANK', '?')}")
    importlib.import_module(module).main([module, *argv])


def name_process(name: str) -> None:
    """What `ps -e`, top and /proc/PID/comm show for this process (15 bytes at most):
    a forked worker keeps its launcher's command line."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_name = 15
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


@contextlib.contextmanager
def every_failure_reported() -> Iterator[None]:
    """Elastic's function path reports only the first rank that failed; the program path
    reports every rank that ended with an error, which is what tells a dead rank from the
    ranks that only lost it. Swap in a context that does the same, for the launch."""
    from torch.distributed.elastic import multiprocessing as elastic_mp
    from torch.distributed.elastic.multiprocessing.api import (
        MultiprocessContext,
        ProcessFailure,
        RunProcsResult,
    )

    class EveryFailureContext(MultiprocessContext):
        def _poll(self) -> RunProcsResult | None:
            result = super()._poll()
            if result is None or not result.failures or self._pc is None:
                return result
            # The first failure closed the context: every process has ended by now.
            for local_rank, process in enumerate(self._pc.processes):
                if local_rank not in result.failures and process.exitcode not in (0, None):
                    result.failures[local_rank] = ProcessFailure(
                        local_rank=local_rank,
                        pid=process.pid,
                        exitcode=process.exitcode,
                        error_file=self.error_files[local_rank],
                    )
            return result

    # setattr: mypy refuses an assignment to a name it knows as a class.
    original = elastic_mp.MultiprocessContext
    setattr(elastic_mp, "MultiprocessContext", EveryFailureContext)  # noqa: B010
    try:
        yield
    finally:
        setattr(elastic_mp, "MultiprocessContext", original)  # noqa: B010
