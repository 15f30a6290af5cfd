"""Imported first by the fork server (its preload list, ddpcli.launcher.fork), and only there
does anything: the server blocks the signals a scheduler sends a whole job, and imports the
rest without the cyclic collector.

The server is in its launcher's process group, and a scheduler ends a job by signalling every
process of it (SLURM's step signal, systemd's control group, `kill -TERM -- -PGID`). The
launcher passes the signal on to its workers, which save a preemption checkpoint; a server
that died of it took its forked workers along first (each dies with its parent, SIGKILLed
before it could save), and their exit codes too (multiprocessing learns them from the server:
255 for each). The server needs no signal to end: it ends with its launcher (its "alive" pipe
closes), which also kills it when the job is over.

Blocked, not ignored: a worker inherits the block, and unblocks once its handlers are its
own (`start_forked_worker`), so a signal that came meanwhile (the agent's, passing one on) is
held for it, not lost.
"""

from __future__ import annotations

import gc
import signal
import sys
from types import FrameType

from ddpcli.process import JOB_SIGNALS


def in_fork_server() -> bool:
    """Whether this import runs inside multiprocessing's fork server (its `main` preloads
    modules before it serves): anywhere else, importing this module changes nothing."""
    from multiprocessing import forkserver

    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if in_fork_server():
    signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    # The preloads that follow import the worker without the cyclic collector (it would
    # cost them a sixth of their CPU time); a worker turns it on as it starts.
    gc.disable()
