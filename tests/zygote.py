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

It serves the commands a test waits on (`run`) and those it acts on while they run
(`start`: a LiveProcess that a test signals or kills mid-epoch), and a command run in a
network namespace (`ip netns exec NS python -m ddpcli ...`, a host of the multi-node tests):
the child joins the namespace as `ip netns exec` would. Commands that a test must see start
as a new interpreter (a `--help` that imports no torch, the launcher's own torch import) use
`subprocess` directly; `DDPCLI_TEST_FRESH=1` starts every command that way.

Run as `python tests/zygote.py SOCKET`: it prints "ready" once it listens, and serves
until its parent (the pytest worker) ends.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
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
NETNS_EXEC = ["ip", "netns", "exec"]
# Room in the zygote's own arguments and environment for each child's (shown_in_proc)
ARG_ROOM, ENV_ROOM = "-" * (1 << 14), "-" * (1 << 16)
# <sched.h> and <sys/mount.h>, for joining a namespace as iproute2's netns_switch() does
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_REC, MS_SLAVE, MNT_DETACH = 1, 0x4000, 1 << 19, 2


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
    if request["netns"]:
        enter_network_namespace(request["netns"])
    if request["ctrl_c"]:  # as a new interpreter started with SIGINT's default sets it
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd >= STREAMS:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    shown_in_proc([sys.executable, "-m", "ddpcli", *request["argv"]], request["env"])
    # As the interpreter sets them at its start: `-m` puts the working folder first, then
    # PYTHONPATH's folders.
    extra = [folder for folder in request["env"].get("PYTHONPATH", "").split(os.pathsep) if folder]
    sys.path[:] = [os.getcwd(), *extra, *sys.path[1:]]
    sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
    sys.pycache_prefix = request["env"].get("PYTHONPYCACHEPREFIX") or None
    tempfile.tempdir = None  # read from TMPDIR afresh
    from ddpcli.launcher.fork import note_torch_unused

    note_torch_unused()
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("ddpcli", run_name="__main__", alter_sys=True)
    sys.exit(0)


def shown_in_proc(argv: list[str], env: dict[str, str]) -> None:
    """/proc/PID/cmdline and /proc/PID/environ read as ARGV's and ENV's, as a new
    interpreter's would: the tests find a job's processes there (its output folder in a
    command line, a test's tag in an environment), and its workers, forked, inherit both.
    Each is written over the memory the kernel reads it from, which ROOM made large enough
    when the zygote started (what does not fit is cut off). Nothing else reads that memory
    any more: Python copied its arguments as it started, and os.environ.clear() removed
    libc's pointers to the old environment."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    arg_start, arg_end, env_start, env_end = (int(field) for field in fields[45:49])
    overwrite(arg_start, arg_end, argv)
    overwrite(env_start, env_end, [f"{name}={value}" for name, value in env.items()])


def overwrite(start: int, end: int, strings: list[str]) -> None:
    """The NUL-terminated STRINGS at START, NULs to END (the last byte stays one: the kernel
    then reads the whole area as it is)."""
    data = b"".join(string.encode(errors="replace") + b"\0" for string in strings)
    data = data[: end - start - 1].ljust(end - start, b"\0")
    ctypes.memmove(start, data, len(data))


def enter_network_namespace(name: str) -> None:
    """Join network namespace NAME as `ip netns exec NAME` does before it runs a command: in
    a mount namespace of this process's own, /sys shows NAME's interfaces (ddpcli reads an
    interface's flags there). The child has one thread, so the whole process moves."""
    libc = ctypes.CDLL(None, use_errno=True)

    def checked(result: int, what: str) -> None:
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"zygote: {what} for netns {name}: {os.strerror(error)}")

    namespace = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    checked(libc.setns(namespace, CLONE_NEWNET), "setns")
    os.close(namespace)
    checked(libc.unshare(CLONE_NEWNS), "unshare")
    checked(libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "mount --make-rslave /")
    flags = 0
    if libc.umount2(b"/sys", MNT_DETACH) != 0 and os.statvfs("/sys").f_flag & os.ST_RDONLY:
        flags = MS_RDONLY  # as ip does: a read-only /sys it could not unmount stays read-only
    checked(libc.mount(name.encode(), b"/sys", b"sysfs", flags, None), "mount sysfs")


# The test side, in the pytest worker.

_zygote: dict[str, object] = {}
_lock = threading.Lock()
# The environment the zygote imports in, set by conftest.py as the worker starts: not one a
# test has changed by the time the first command runs (OpenMP and torch read some of it as
# they load).
environment: dict[str, str] = {}


def ddpcli_arguments(command: list[str]) -> tuple[str | None, list[str]] | None:
    """(the network namespace, ddpcli's arguments) of `[ip netns exec NS] python -m ddpcli
    ARGS`, which the zygote can run (the namespace None where there is no `ip netns exec`);
    None for any other command."""
    namespace = None
    if command[:3] == NETNS_EXEC and len(command) > 3:
        namespace, command = command[3], command[4:]
    if command[:3] != [sys.executable, "-m", "ddpcli"]:
        return None
    return namespace, command[3:]


def serves(command: list[str]) -> bool:
    """Whether the zygote can run COMMAND (`ddpcli_arguments`)."""
    return (
        ddpcli_arguments(command) is not None
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
    env = {**(environment or os.environ), "PYTHONUNBUFFERED": "1", "ZYGOTE_ROOM": ENV_ROOM}
    process = subprocess.Popen(
        [sys.executable, __file__, path, ARG_ROOM], stdout=subprocess.PIPE, env=env, text=True
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


class Process:
    """A command forked from the zygote, with what of subprocess.Popen the tests use: its
    pid (its session's too), poll, wait, communicate, send_signal, kill; the read ends of its
    stdout (None where it goes to /dev/null) and stderr. The zygote is its parent, and sends
    its exit code when it has reaped it."""

    def __init__(
        self, command: list[str], connection: socket.socket, stdout: int | None, stderr: int
    ) -> None:
        self.args, self.returncode = command, None
        self.connection, self.stdout_fd, self.stderr_fd = connection, stdout, stderr
        self.pid = int(connection.recv(64))
        self.readers: list[StreamReader] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.connection.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._ended(self.connection.recv(64))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.connection.settimeout(timeout)
            try:
                self._ended(self.connection.recv(64))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
        return self.returncode  # type: ignore[return-value]

    def _ended(self, message: bytes) -> None:
        # an empty message: the zygote itself ended (its pytest worker is going)
        self.returncode = int(message) if message else -signal.SIGKILL
        self.connection.close()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its stdout and stderr as text, once it has ended and closed both."""
        if self.readers is None:
            assert self.stdout_fd is not None, "its stdout goes to /dev/null"
            self.readers = [StreamReader(self.stdout_fd), StreamReader(self.stderr_fd)]
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not all(reader.join(deadline) for reader in self.readers):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        stdout, stderr = (reader.text() for reader in self.readers)
        return stdout, stderr

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # as Popen: never a pid that may have been reused
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(
    command: list[str],
    env: dict[str, str],
    cwd: str | Path,
    *,
    keep_stdout: bool = True,
    ctrl_c: bool = False,
) -> Process | None:
    """COMMAND forked from the zygote in a session of its own, with no input, its stdout
    kept (else sent to /dev/null) and its stderr. CTRL_C: SIGINT as a terminal's foreground
    job has it, though this test run ignores it. None if there is no zygote."""
    path = socket_path()
    arguments = ddpcli_arguments(command)
    if path is None or arguments is None:
        return None
    namespace, argv = arguments
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    out_read, out_write = os.pipe() if keep_stdout else (None, os.open(os.devnull, os.O_WRONLY))
    err_read, err_write = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY)
    request = {"argv": argv, "env": env, "cwd": str(cwd), "netns": namespace, "ctrl_c": ctrl_c}
    socket.send_fds(connection, [json.dumps(request).encode()], [stdin, out_write, err_write])
    for fd in (stdin, out_write, err_write):
        os.close(fd)
    return Process(command, connection, out_read, err_read)


def run(
    command: list[str], timeout: float, env: dict[str, str], cwd: str | Path
) -> subprocess.CompletedProcess | None:
    """COMMAND forked from the zygote, as `subprocess.run` in a session of its own would
    run it; on timeout its whole session is killed and the test fails. None if there is no
    zygote."""
    process = start(command, env, cwd)
    if process is None:
        return None
    try:
        stdout, stderr = process.communicate(timeout)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):  # what it wrote, if not all
            process.communicate(10)
        stderr = process.readers[1].text() if process.readers else ""
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(command)}\n{stderr[-3000:]}"
        ) from None
    kill_session(process.pid)  # nothing of the job may outlive it
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


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

    def join(self, deadline: float | None) -> bool:
        self.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()

    def text(self) -> str:
        text = b"".join(self.chunks).decode(errors="replace")
        return text.replace("\r\n", "\n").replace("\r", "\n")  # as text=True reads it


if __name__ == "__main__":
    serve(sys.argv[1])
