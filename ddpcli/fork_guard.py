"""A rank forks its loader workers only while its other threads sleep.

A forked child of Python 3.11 and older (fixed in 3.12 and in late 3.11 patch releases;
this machine's 3.11.7 has it) takes the interpreter's thread-list lock before it resets it
(CPython gh-112275): if another thread of the parent held it at the fork, the child hangs
before it runs a line. The process group's own threads take it: a Gloo run-loop thread (an
NCCL watchdog too) that frees a finished collective's work drops the Python tensors it held,
and acquiring the GIL for that from a C++ thread creates a thread state under the lock,
without the GIL the forking thread holds. Seen about once in 2,000 loader workers forked
right after a collective on a busy 2-core machine (the shards path forks its workers every
epoch): one rank waited forever for its first validation batch.

Such a thread is running while it holds the lock, and a thread that sleeps waits for work
that only this thread enqueues, so a fork is made safe by waiting, before it, until every
other thread of the process sleeps. The wait is bounded (a thread that spins would delay
every fork by it); it is nearly always a few microseconds: one read of /proc per thread.
Kept on a Python that has the fix: a lock of any library that a running thread holds at
a fork is inherited held all the same.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

# The longest a fork waits for the other threads to sleep; then it goes ahead.
QUIET_WAIT_S = 0.05
_POLL_S = 0.0005
_registered = False


def fork_only_when_quiet() -> None:
    """From now on every fork of this process (loader workers, pools) waits, before it,
    for its other threads to sleep. Linux only, once per process; a child inherits it."""
    global _registered
    if _registered or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=wait_for_quiet_threads)
    _registered = True


def wait_for_quiet_threads(limit_s: float = QUIET_WAIT_S) -> bool:
    """True once no other thread of this process is running (or after LIMIT_S, False)."""
    give_up_at = time.monotonic() + limit_s
    while busy_threads():
        if time.monotonic() > give_up_at:
            return False
        time.sleep(_POLL_S)
    return True


def busy_threads() -> list[int]:
    """This process's other threads that are running or about to (not asleep, nor stopped
    by a debugger): their ids."""
    me = threading.get_native_id()
    busy = []
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        state = stat[stat.rindex(")") + 2]  # the name, in brackets, may hold anything
        if int(task.name) != me and state not in "StTIZX":
            busy.append(int(task.name))
    return busy
