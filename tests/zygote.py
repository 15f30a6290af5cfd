"""`python -m ddpcli ARGS` for the tests, forked from a process that imported torch once.

A test that runs the CLI pays a new interpreter's imports before the command does anything:
torch, torch._dynamo (DDP's constructor reads its settings), torchvision and matplotlib,
about 3 of a short run's 4.5 CPU-seconds. Hundreds of such runs made most of the suite's time.
The zygote imports those libraries once per pytest worker, runs nothing of them, and forks
each command from itself: the child takes the command's arguments, environment, working
folder and standard streams, starts a session of its own (as `start_new_session` does), and
runs ddpcli's `__main__` as `python -m` would. ddpcli itself is imported afresh in every
child, after its environment is set: its modules read the terminal and the environment as
they load. The child is a launcher like any other: it forks its fork server from itself
(`ddpcli.launcher.fork.note_torch_unused`), and its exit code comes back to the test.

Commands that a test must see start as a new interpreter (a `--help` that imports no torch,
the launcher's own torch import) use `subprocess` directly; `DDPCLI_TEST_FRESH=1` starts
every command that way.

Run as `python tests/zygote.py SOCKET`: it prints "ready" once it listens, and serves
until its parent (the pytest worker) ends.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# What every launch imports beside ddpcli, without reading its environment as it loads.
PRELOADED = (
    "torch",
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torchvision",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "pydantic",
    "typer",
)
REQUEST_BYTES = 1 << 20  # a command's arguments and environment, in one message
STREAMS = 3  # stdin, stdout, stderr


# The server side, in the zygote process.


def serve(socket_path: str) -> None:
    # As ddpcli.process.collector_paused and freeze_imported_objects do; not called, since
    # ddpcli is never imported here (its modules read the terminal as they load).
    gc.disable()  # imports allocate many objects and free few: the collector would only slow them
    for module in PRELOADED:
        importlib.import_module(module)
    gc.freeze()  # what the children share stays shared (no collector writes to its pages)
    gc.enable()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    print("ready", flush=True)
    parent = os.getppid()
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its test waits on
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            connection, _ = listener.accept()
            pid = fork_command(connection, listener, waiting)
            waiting[pid] = connection
        report_ended(waiting)


def fork_command(
    connection: socket.socket, listener: socket.socket, waiting: dict[int, socket.socket]
) -> int:
    message, fds, _, _ = socket.recv_fds(connection, REQUEST_BYTES, STREAMS)
    request = json.loads(message)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in [*waiting.values(), connection]:
            other.close()
        become_command(request, fds)  # raises SystemExit: the interpreter ends as any other
    for fd in fds:
        os.close(fd)
    connection.send(str(pid).encode())
    return pid


def report_ended(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):  # its test gave up on it
                connection.send(str(os.waitstatus_to_exitcode(status)).encode())
            connection.close()


def become_command(request: dict, fds: list[int]) -> None:
    """In the child: the process `python -m ddpcli ARGS` would be, from here on."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd >= STREAMS:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # As the interpreter sets them at its start: `-m` puts the working folder first, then
    # PYTHONPATH's folders.
    extra = [folder for folder in request["env"].get("PYTHONPATH", "").split(os.pathsep) if folder]
    sys.path[:] = [os.getcwd(), *extra, *sys.path[1:]]
    sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
    tempfile.tempdir = None  # read from TMPDIR afresh
    from ddpcli.launcher.fork import note_torch_unused

    note_torch_unused()
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("ddpcli", run_name="__main__", alter_sys=True)
    sys.exit(0)


# The test side, in the pytest worker.

_zygote: dict[str, object] = {}
_lock = threading.Lock()
# The environment the zygote imports in, set by conftest.py as the worker starts: not one a
# test has changed by the time the first command runs (OpenMP and torch read some of it as
# they load).
environment: dict[str, str] = {}


def serves(command: list[str]) -> bool:
    """Whether COMMAND is `python -m ddpcli ...`, which the zygote can run."""
    return (
        command[:3] == [sys.executable, "-m", "ddpcli"]
        and not os.environ.get("DDPCLI_TEST_FRESH")
        and sys.platform.startswith("linux")
    )


def socket_path() -> str | None:
    """The zygote's socket, started on first use in this pytest worker; None if it could
    not start (the commands then start as new interpreters)."""
    with _lock:
        if "path" not in _zygote:
            _zygote["path"] = start_zygote()
        return _zygote["path"]  # type: ignore[return-value]


def start_zygote() -> str | None:
    folder = tempfile.mkdtemp(prefix="ddpcli-zygote-")
    path = os.path.join(folder, "socket")
    env = {**(environment or os.environ), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, __file__, path], stdout=subprocess.PIPE, env=env, text=True
    )
    atexit.register(stop_zygote, process, folder)
    ready = process.stdout.readline() if process.stdout else ""
    return path if ready.strip() == "ready" else None


def stop_zygote(process: subprocess.Popen, folder: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait()
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(folder, "socket"))
        os.rmdir(folder)


def run(
    command: list[str], timeout: float, env: dict[str, str], cwd: str | Path
) -> subprocess.CompletedProcess | None:
    """COMMAND forked from the zygote, as `subprocess.run` in a session of its own would
    run it; on timeout its whole session is killed and the test fails. None if there is no
    zygote."""
    path = socket_path()
    if path is None:
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY)
    request = {"argv": command[3:], "env": env, "cwd": str(cwd)}
    socket.send_fds(connection, [json.dumps(request).encode()], [stdin, out_write, err_write])
    for fd in (stdin, out_write, err_write):
        os.close(fd)
    pid = int(connection.recv(64))
    deadline = time.monotonic() + timeout
    readers = [StreamReader(out_read), StreamReader(err_read)]
    code = wait_for_exit(connection, deadline)
    timed_out = code is None or not all(reader.join(deadline) for reader in readers)
    kill_session(pid)  # nothing of the job may outlive it
    connection.close()
    stdout, stderr = (reader.text(wait=True) for reader in readers)
    if timed_out:
        raise AssertionError(f"timed out after {timeout}s: {' '.join(command)}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def wait_for_exit(connection: socket.socket, deadline: float) -> int | None:
    connection.settimeout(max(0.0, deadline - time.monotonic()))
    try:
        return int(connection.recv(64))
    except (TimeoutError, ValueError):
        return None


def kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class StreamReader:
    """A pipe read to its end in a thread, as `communicate` reads one."""

    def __init__(self, fd: int) -> None:
        self.chunks: list[bytes] = []
        self.thread = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self.thread.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as stream:
            while chunk := stream.read1(1 << 16):
                self.chunks.append(chunk)

    def join(self, deadline: float) -> bool:
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()

    def text(self, wait: bool) -> str:
        if wait:
            self.thread.join(10)
        text = b"".join(self.chunks).decode(errors="replace")
        return text.replace("\r\n", "\n").replace("\r", "\n")  # as text=True reads it


if __name__ == "__main__":
    serve(sys.argv[1])
