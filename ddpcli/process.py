"""How a ddpcli process uses the C library's heap, and how it ends.

The heap and the clean exit matter for speed and change nothing a process computes
(measured figures in docs/performance.md); a failing rank ends at once, with one line.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import io
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from ddpcli import ui
from ddpcli.files import write_text_atomic

Returns = TypeVar("Returns")


def keep_freed_memory() -> None:
    """glibc hands large freed blocks back to the kernel, and every step then page-faults
    them in again (docs/performance.md has the counts). Fixed thresholds keep them in the
    heap. A user's own malloc setting wins; on a C library other than glibc there is
    nothing to do."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum; also ends its dynamic threshold
    mallopt(m_trim_threshold, 1 << 30)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """For a burst of imports: they create hundreds of thousands of objects and next to no
    garbage, and the cyclic collector, run again and again meanwhile, costs torch's import
    about a sixth of its CPU time (docs/performance.md)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_imported_objects() -> None:
    """What the imports created (torch alone: hundreds of thousands of objects) lives until
    exit. Out of the cyclic collector's sight, it costs no later collection anything to walk."""
    gc.freeze()


def collect_then_freeze() -> None:
    """At exit the interpreter's cyclic collector walks every live object several times,
    most of a process's exit time with torch loaded (docs/performance.md). One collection
    now frees whatever the run left in reference cycles, as the exit would have, but while
    the interpreter is whole (Gloo's threads must not meet a half torn-down interpreter);
    freezing the rest leaves the exit nothing to walk."""
    gc.collect()
    gc.freeze()


def exit_with_error(message: str, exit_code: int) -> NoReturn:
    """A rank's last word: one line, then out at once (end_quietly)."""
    faulthandler.unregister(signal.SIGTERM)  # before the line: no stack dump while it prints
    ui.error(message)
    end_quietly(exit_code)


def end_quietly(exit_code: int) -> NoReturn:
    """Out at once, skipping atexit hooks that could wait on dead peers. The agent now stops
    the other ranks with SIGTERM, maybe this one too: no stack dump for that."""
    faulthandler.unregister(signal.SIGTERM)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


# The process a worker dies with: the elastic agent, or the fork server it forks from.
PARENT_PID_VARIABLE = "DDPCLI_PARENT_PID"


# multiprocessing's sockets (the fork server's; a DataLoader worker's, handing a batch's
# memory over) are TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a UNIX socket's path holds
# at most 107 bytes: a scheduler's long job folder as TMPDIR leaves no room for them.
UNIX_SOCKET_PATH_MAX = 107
ROOM_FOR_TMPDIR = UNIX_SOCKET_PATH_MAX - len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def multiprocessing_sockets_fit() -> bool:
    return len(os.fsencode(tempfile.gettempdir())) <= ROOM_FOR_TMPDIR


# What a launcher passes on to its workers (SIGINT aside), and what a scheduler sends every
# process of a job to end it: SLURM's step signal (`--signal=USR1@90` too), systemd's control
# group, `kill -TERM -- -PGID`.
JOB_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def leave_job_signals_to_parent() -> None:
    """For a rank's helper process (a loader worker): a job's signal sent to every process
    of it is the rank's to answer. A helper that died of it took its rank down before the
    rank could save its preemption checkpoint; it ends with its rank. (The fork server
    blocks them: ddpcli.launcher.fork_server_setup.)"""
    for signum in JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def whole_lines() -> None:
    """Each line said in one write. Under PYTHONUNBUFFERED (common in containers) print()
    writes a line's text and its newline apart, and the launcher and every rank share one
    terminal: a rank stopped between the two left its line open, and the launcher's next
    line ran on from it."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def die_with_parent() -> None:
    """The elastic agent starts each worker in its own session, so when the agent itself is
    killed (SIGKILL, the OOM killer, a scheduler) nothing stops its workers, and they train
    on as orphans. Ask the kernel to kill this worker when its parent dies (the agent, or
    the fork server, which ends with the agent: ddpcli.launcher.fork)."""
    parent = os.environ.get(PARENT_PID_VARIABLE)
    if parent:
        die_with(int(parent))


def die_with(parent_pid: int) -> None:
    """SIGKILL from the kernel when this process's parent, PARENT_PID, dies; out at once if
    it already has. Linux only: elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


@functools.cache
def _whole_file_error_handler() -> Any:
    """Elastic's ErrorHandler, writing the error file whole or not at all, with the error's
    own traceback. Elastic writes it in place, and after the first failure it stops the other
    ranks and reads each one's file: a rank stopped in mid-write left an empty or cut file, on
    which elastic raised JSONDecodeError instead of reporting the job. And it takes the
    traceback from sys.exc_info(), which is "NoneType: None" for an error recorded outside
    its except block (a rank's watcher thread leaving for a failed peer)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class WholeFileErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            error_file = self._get_error_file_path()
            if not error_file:
                return super().record_exception(e)  # no file to write: elastic logs it
            said = {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": "".join(traceback.format_exception(e)),
                    "timestamp": str(int(time.time())),
                },
            }
            write_text_atomic(Path(error_file), json.dumps({"message": said}))

    return WholeFileErrorHandler()


def record_for_agent(error: BaseException) -> None:
    """The traceback goes to the agent's error file for its report. A full disk (or a gone
    folder) must not turn the rank's one line into a stack of its own."""
    with contextlib.suppress(OSError):
        _whole_file_error_handler().record_exception(error)


def recorded(main: Callable[..., Returns]) -> Callable[..., Returns | None]:
    """Elastic's @record (an uncaught exception goes to the agent's error file), with the
    file written whole."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(main, _whole_file_error_handler())
