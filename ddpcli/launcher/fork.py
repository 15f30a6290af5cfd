"""Workers forked from a fork server instead of started as new interpreters.

A new interpreter imports torch again in every worker: seconds of CPU per rank, paid
again on every restart, and on a machine with few cores the ranks' imports queue behind
each other. A forked worker finds torch and ddpcli already imported.

They are forked from a fork server (Python's multiprocessing `forkserver`), not from the
launcher: the launcher has threads (the elastic agent's store server answers the first
ranks' connections while the next ones are being forked), and a child forked while another
thread holds a lock of the C library (the resolver's, taken to name a connection's peer)
inherits it held and hangs on it forever; seen as 1 job in 10 on a busy 2-core machine. The
server has no thread: it imports the worker module once, while the launcher forms the job,
and forks each worker on request.

The server itself is forked from the launcher, the moment the launcher has imported torch
and before it has run anything of it (`server_forked_from_here`): the server starts with
torch imported instead of importing it again, 2 CPU-seconds saved on every CPU launch.
Where that moment has passed (torch already imported, or a thread started), the server is
a new interpreter, as multiprocessing starts it.

Forking is for CPU jobs only: GPU jobs start fresh interpreters, since CUDA cannot be used
in a forked child of a process that may have touched it.

torch.distributed.elastic runs a function (instead of a program) through its
MultiprocessContext; this module adapts that path to behave as the program path does:
each worker in a session of its own, with Python's default signal handlers, dying with the
launcher, every failed rank reported, not only the first, and no hang at the end when a
worker is killed as it finishes.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from ddpcli.process import (
    JOB_SIGNALS,
    PARENT_PID_VARIABLE,
    collector_paused,
    multiprocessing_sockets_fit,
)

# The signals elastic's agent catches (to pass on), which the fork server blocks
# (FORK_SERVER_SETUP): a forked child would inherit either.
_INHERITED_HANDLERS = JOB_SIGNALS
# Preloaded first by the fork server: there it blocks a job's signals.
FORK_SERVER_SETUP = "ddpcli.launcher.fork_server_setup"


# A child of the fork server first runs the launcher's main script again (multiprocessing
# does, as __mp_main__): the `ddpcli` script imports this. In the server it is done once.
LAUNCHER_MAIN = "ddpcli.cli"


def forks_workers(uses_gpus: bool) -> bool:
    """Whether a job's workers are forked: CPU jobs on Linux (macOS's system frameworks
    are not safe to use in a forked child; Windows cannot fork), where the fork server's
    socket fits in the temporary folder (else the workers start as programs)."""
    return not uses_gpus and sys.platform.startswith("linux") and multiprocessing_sockets_fit()


@contextlib.contextmanager
def fork_server(module: str) -> Iterator[str]:
    """Start the fork server, importing MODULE in the background while the launcher goes on
    (torch too, unless it is forked from here with torch: `server_forked_from_here`); yields
    its pid, the workers' parent. An inner use finds it
    running and leaves it to the outer one, which stops it: a server outliving its launch
    would give the next launch's workers this one's environment."""
    from multiprocessing import forkserver

    started_earlier = fork_server_pid() is not None  # in this command, by an outer use
    forkserver.set_forkserver_preload([FORK_SERVER_SETUP, module, LAUNCHER_MAIN])
    with server_forked_from_here():
        forkserver.ensure_running()  # also starts a new one if the earlier one died
    pid = fork_server_pid()
    assert pid is not None
    if started_earlier:
        yield str(pid)
        return
    try:
        yield str(pid)
    finally:
        # Its workers have ended. Killed, not asked to exit: an interpreter that imported
        # torch takes most of a second to finish, and the launcher would wait for it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):  # its socket may be gone with the temp folder
            the_fork_server()._stop()


# The threads this process had when it noted that torch was imported and nothing of it had
# run since (None: not noted; torch may have run).
_threads_while_torch_unused: int | None = None


def note_torch_unused() -> None:
    """Torch is imported here and nothing of it has run since: a fork server may be forked
    from this process while no thread appears (`server_forked_from_here`). Noted right after
    the launcher's own import, or by a process forked from one that imported torch and ran
    nothing of it (tests/zygote.py)."""
    global _threads_while_torch_unused
    _threads_while_torch_unused = os_thread_count()


def torch_unused_since_noted() -> bool:
    """A parallel region of OpenMP leaves its threads behind, as would anything else that
    started one: more threads than when noted means torch (or something) has run."""
    noted = _threads_while_torch_unused
    return noted is not None and os_thread_count() <= noted


def os_thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@contextlib.contextmanager
def server_forked_from_here() -> Iterator[None]:
    """Within: a fork server that multiprocessing starts is forked from this process after
    it imports torch, instead of started as a new interpreter that would import it again.

    Only while nothing of torch has run here yet: a child forked after OpenMP ran a parallel
    region with several threads hangs at its own first one (GNU OpenMP keeps no fork
    handler), so torch is imported here, or was noted unused (`note_torch_unused`); and
    with no other Python thread, which could hold a lock the child would inherit held."""
    if threading.active_count() > 1 or not os.path.isdir("/proc/self/task"):
        yield
        return
    if "torch" not in sys.modules:
        with collector_paused():
            import torch  # noqa: F401 - the import the server shares instead of repeating
        note_torch_unused()
    if not torch_unused_since_noted():
        yield
        return
    from multiprocessing import resource_tracker

    util: Any = multiprocessing.util  # private members used: typeshed does not list them
    resource_tracker.ensure_running()  # its own process, started as multiprocessing does
    spawn_new_interpreter = util.spawnv_passfds
    open_before = set(open_fds())

    def fork_instead(path: Any, args: Sequence[str], passfds: Sequence[int]) -> int:
        if "forkserver" not in args[-1]:  # not the server's command: as multiprocessing does
            return int(spawn_new_interpreter(path, args, passfds))
        util._flush_std_streams()  # else the server's children would print it again
        pid = os.fork()
        if pid == 0:
            serve_as_forked_server(args[-1], open_before | {0, 1, 2, *passfds})
        return pid

    util.spawnv_passfds = fork_instead
    try:
        yield
    finally:
        util.spawnv_passfds = spawn_new_interpreter


def serve_as_forked_server(command: str, keep_fds: set[int]) -> None:
    """In the forked child: what a new interpreter started by multiprocessing would not
    have had, dropped, then the server's own command (`python -c COMMAND`'s). Never returns."""
    from multiprocessing import forkserver, resource_tracker

    try:
        # The "alive" pipe's write end and the like: opened for the server's start. A server
        # holding its own alive pipe would never see its launcher end.
        for fd in set(open_fds()) - keep_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        # The launcher's resource tracker: each worker is handed it by the server's protocol.
        tracker: Any = resource_tracker._resource_tracker
        if tracker._fd is not None:
            with contextlib.suppress(OSError):
                os.close(tracker._fd)
        tracker._fd = tracker._pid = None
        # Held by the launcher as it forked (ensure_running's), so held here for good.
        server: Any = forkserver._forkserver
        server._lock = threading.Lock()
        exec(command, {"__name__": "__forkserver__"})
    except SystemExit:  # its launcher ended
        pass
    except BaseException:  # noqa: BLE001 - said as a new interpreter would, then gone
        traceback.print_exc()
    finally:
        os._exit(0)  # never back into the launcher's code


def open_fds() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def start_forked_worker(parent_pid: str, env: dict[str, str], module: str, *argv: str) -> None:
    """A worker's entry point: `python -m MODULE *ARGV` with the job's ENV, in a child of
    the fork server PARENT_PID (which may have started before the job's ENV was known)."""
    leave_fork_server(parent_pid)
    gc.enable()  # the server imported without it (ddpcli.launcher.fork_server_setup)
    os.environ.update(env)
    # multiprocessing handed this child its parent's start method: the worker's own
    # children (DataLoader workers) are forked from it, as under torchrun.
    multiprocessing.set_start_method("fork", force=True)
    # Like the agent's program path: the terminal's Ctrl-C reaches the agent alone, which
    # passes it on; the worker does not get it twice.
    with contextlib.suppress(OSError):
        os.setsid()
    for signum in _INHERITED_HANDLERS:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Blocked in the server (ddpcli.launcher.fork_server_setup): one that came since the fork
    # is delivered now, as it would have been to a worker started as a program.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _INHERITED_HANDLERS)
    name_process(f"ddpcli rank {os.environ.get('RANK', '?')}")
    importlib.import_module(module).main([module, *argv])


def the_fork_server() -> Any:
    """multiprocessing's one ForkServer. Its pid, its "alive" pipe and its stop are private
    attributes, as is a process's temporary folder (tests/test_fork.py fails if a Python
    version renames them)."""
    from multiprocessing import forkserver

    return forkserver._forkserver


def fork_server_pid() -> int | None:
    pid: int | None = the_fork_server()._forkserver_pid
    return pid


def leave_fork_server(parent_pid: str) -> None:
    """The server lives as long as any process holds its "alive" pipe, and its children
    are handed one: a worker that kept it would keep its parent alive after the launcher
    died, so the worker's death signal (ddpcli.process.die_with_parent) would never come.
    The parent to die with is the server, which ends when the launcher does."""
    server = the_fork_server()
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    os.environ[PARENT_PID_VARIABLE] = parent_pid
    # It was also handed the launcher's multiprocessing folder, which the launcher removes
    # as it exits: a DataLoader worker still ending then could not unlink its socket there
    # and would print a traceback after the launcher's last line. Its own, made on demand.
    process: Any = multiprocessing.current_process()
    process._config.pop("tempdir", None)


def name_process(name: str) -> None:
    """What `ps -e`, top and /proc/PID/comm show for this process (15 bytes at most):
    a forked worker keeps its launcher's command line."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_name = 15
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


class WorkersMayExit:
    """The agent's word to its function workers that it has read their return values, so
    they may exit (elastic's `_worker_finished_event`). A multiprocessing Event's set()
    waits for every sleeping waiter to wake, so a worker killed as it waited hung the
    launcher for good (torch's comment on it says as much). Here each worker takes a token
    of a semaphore: set() never waits, and a dead worker's token is left unused."""

    def __init__(self, context: Any, workers: int) -> None:
        self._tokens = context.Semaphore(0)
        self._workers = workers

    def set(self) -> None:
        for _ in range(self._workers):
            self._tokens.release()

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self._tokens.acquire(True, timeout))


@contextlib.contextmanager
def function_path_fixed() -> Iterator[None]:
    """Elastic's function path, made to end as its program path does, for the launch:
    - it reports only the first rank that failed; the program path reports every rank that
      ended with an error, which is what tells a dead rank from the ranks that only lost it;
    - its end could hang for good on a worker killed just as it finished (WorkersMayExit);
    - a worker that returned when the agent stopped it waited for SIGKILL (`_close`)."""
    from torch.distributed.elastic import multiprocessing as elastic_mp
    from torch.distributed.elastic.multiprocessing.api import ProcessFailure, RunProcsResult

    # On the context elastic would use now: another patch of it
    # (ddpcli.launcher.peer_failure) holds.
    class FixedContext(elastic_mp.MultiprocessContext):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            context = multiprocessing.get_context(self.start_method)
            # Elastic calls set() and wait() on it, which WorkersMayExit has; not an Event.
            self._worker_finished_event = WorkersMayExit(context, self.nprocs)  # type: ignore[assignment]

        def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
            # A worker that has returned waits for the word that the agent read its result.
            # An agent that stops its workers instead (a host joining an elastic job, a
            # signal to the launcher) never gave it: a worker that had stopped cleanly on
            # the SIGTERM sat out the agent's whole grace (30 s) until SIGKILL.
            self._worker_finished_event.set()
            super()._close(death_sig, timeout)

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
    setattr(elastic_mp, "MultiprocessContext", FixedContext)  # noqa: B010
    try:
        yield
    finally:
        setattr(elastic_mp, "MultiprocessContext", original)  # noqa: B010
