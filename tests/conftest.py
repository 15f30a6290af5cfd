"""Shared test helpers: run the real CLI in a subprocess, always with a timeout."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import zygote

REPO = Path(__file__).resolve().parents[1]


def torch_at_least(major: int, minor: int) -> bool:
    """The installed torch is MAJOR.MINOR or newer (read without importing it)."""
    from importlib.metadata import version

    return tuple(int(part) for part in version("torch").split(".")[:2]) >= (major, minor)


# torch's own analyzer (fr_trace) reads Gloo's flight records from torch 2.12 on: 2.11's takes
# NCCL's only (ddpcli's verdict reads both: ddpcli.collectives.verdict.in_nccls_words).
ANALYZER_READS_GLOO = pytest.mark.skipif(
    not torch_at_least(2, 12), reason="torch's fr_trace reads Gloo records from torch 2.12"
)

# Threads that wait for work sleep instead of spinning. The tests run three at a time on a
# machine of two cores, each with ranks of its own: a spinning OpenMP thread then burns a
# core another test's rank needs (docs/performance.md, "The test suite's time"). Set before
# torch is imported here, and inherited by every command a test runs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def bytecode_kept(folder: Path) -> None:
    """Python's compiled modules kept in FOLDER, for this process and every one the tests
    start, whatever PYTHONDONTWRITEBYTECODE says. Where it is set (and pip installed with
    --no-compile, as the README does), every new interpreter compiled the Python of torch
    and ddpcli again: `import torch, torch._dynamo` took 5.5 CPU-seconds instead of 2.0, in
    each of the suite's hundreds of processes. The folder is outside the checkout and the
    venv, and the .pyc files in it are checked against their sources as always."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ.setdefault("PYTHONPYCACHEPREFIX", str(folder))
    sys.dont_write_bytecode = False
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]


bytecode_kept(Path(tempfile.gettempdir()) / "ddpcli-tests-pycache")
zygote.environment.update(os.environ)  # the one its commands' libraries load in


LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


@contextlib.contextmanager
def benchmark_module(name: str):
    """benchmarks/NAME.py, imported as the scripts import each other: their folder on sys.path
    while the module is in use."""
    folder = str(REPO / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (a test may itself run under one)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in LAUNCHER_VARIABLES
        and not name.startswith(("SLURM_", "TORCHELASTIC_", "PET_"))
    }
    return {**env, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **extra}


def tagged(env: dict[str, str], command: list[str]) -> dict[str, str]:
    """ENV with COMMAND in it: a worker forked from ddpcli's fork server has the server's
    command line, but the environment the launcher started the server with
    (test_faults.leftover_workers finds a run's workers by either)."""
    return {**env, "DDPCLI_TEST_COMMAND": " ".join(command)}


# Warnings that depend on the machine's load, not on the run's settings: a busy CI core
# makes one rank the straggler, or the data wait long.
LOAD_WARNINGS = ("is the slowest", "waiting for data takes")


def settings_warnings(stderr: str) -> list[str]:
    """The run's warning lines, less those about the machine's load."""
    return [
        line
        for line in stderr.splitlines()
        if "warning" in line and not any(words in line for words in LOAD_WARNINGS)
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def traced_records(trace: Path, rank: int, epoch: int | None = None) -> list[dict]:
    """Rank RANK's training batches in the order it was handed them (DDPCLI_TRACE_SAMPLES=TRACE
    writes TRACE.rankN: one record per batch, its epoch, world and sample indices), of EPOCH
    only when given."""
    lines = trace.with_name(f"{trace.name}.rank{rank}").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [record for record in records if epoch is None or record["epoch"] == epoch]


def traced_counts(trace: Path, ranks: int, epoch: int | None = None) -> Counter:
    """How often each sample index was handed out for training, over ranks 0..RANKS-1, in
    EPOCH only when given."""
    return Counter(
        index
        for rank in range(ranks)
        for record in traced_records(trace, rank, epoch)
        for index in record["indices"]
    )


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_cli(*args: str, timeout: float = 120, env: dict | None = None, cwd=None):
    """`python -m ddpcli ARGS` as a user would run it; a hang fails the test, not CI."""
    return run_bounded(
        [sys.executable, "-m", "ddpcli", *args], timeout, clean_env(**(env or {})), cwd
    )


@pytest.fixture
def in_process(monkeypatch):
    """`ddpcli ARGS` in this process, for a command that ends before any worker starts (bad
    input's exit 2, a --dry-run): no interpreter and no torch import per call, several
    CPU-seconds each as a process. The environment run_cli gives (no launcher's variables,
    a wide terminal), from CWD; a train's fork server is not started (it would import
    torch for nothing). A CompletedProcess, as run_cli's."""
    from typer.testing import CliRunner

    from ddpcli.cli import app

    for name in os.environ.keys() - clean_env().keys():
        monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(
        "ddpcli.launcher.engine.early_fork_server", lambda *args: contextlib.nullcontext()
    )
    monkeypatch.setattr("gc.freeze", lambda: None)  # a launch's: for good, in this process

    def invoke(*args: str, cwd=None):
        monkeypatch.chdir(cwd or REPO)
        result = CliRunner().invoke(app, list(args), catch_exceptions=False)
        return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)

    return invoke


@pytest.fixture(autouse=True)
def no_fork_server_left():
    """A command run in this process (`data pack` through CliRunner) may start
    multiprocessing's fork server, which would outlive its test in this worker: stopped, as
    a command's own process would have ended. tests/test_fork.py starts from none."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    running_before = server._forkserver_pid is not None
    yield
    if not running_before and server._forkserver_pid is not None:
        with contextlib.suppress(OSError, ChildProcessError):
            server._stop()


def run_bounded(command: list[str], timeout: float, env: dict | None = None, cwd=None):
    """Run a command in its own session; on timeout kill the whole process group (the
    launcher and every worker), then fail the test the way subprocess.run would.
    `python -m ddpcli ...` is forked from the zygote (tests/zygote.py) where it runs."""
    env = tagged(env or dict(os.environ), command)
    if zygote.serves(command) and (done := zygote.run(command, timeout, env, cwd or REPO)):
        return done
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd or REPO,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process.pid)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(command)}\n{stderr[-3000:]}"
        ) from None
    kill_group(process.pid)  # nothing of the job may outlive it
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def popen(command: list[str], env: dict[str, str], cwd=REPO):
    """COMMAND started in its own session, its stdout and stderr piped as text: a
    subprocess.Popen, or for `[ip netns exec NS] python -m ddpcli ...` a process forked from
    the zygote (tests/zygote.py) with the same poll, wait, communicate, kill and pid."""
    env = tagged(env, command)
    forked = zygote.serves(command) and zygote.start(command, env, cwd)
    return forked or subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
        start_new_session=True,
    )  # fmt: skip


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def ignores_ctrl_c() -> bool:
    """This test run ignores SIGINT (started in the background by a non-interactive shell):
    so would its commands, and a test's Ctrl-C would change nothing."""
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def answer_ctrl_c() -> None:
    """SIGINT's default in a command, as a terminal's foreground job has it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class LiveProcess:
    """A command in its own session, its stderr read line by line as it comes, so that a
    test can act at a chosen moment (kill a worker mid-epoch, cut a node off).
    `[ip netns exec NS] python -m ddpcli ...` is forked from the zygote (tests/zygote.py)."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None):
        env = tagged(env or clean_env(), command)
        forked = zygote.serves(command) and zygote.start(
            command, env, REPO, keep_stdout=False, ctrl_c=ignores_ctrl_c()
        )
        if forked:
            self.process = forked
            # text, as Popen's text=True reads it; _read closes it at its end
            self.stream = open(forked.stderr_fd, errors="replace")  # noqa: SIM115
        else:
            self.process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env=env, cwd=REPO, start_new_session=True,
                preexec_fn=answer_ctrl_c if ignores_ctrl_c() else None,
            )  # fmt: skip
            self.stream = self.process.stderr
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with self.stream:
            for line in self.stream:
                self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.lines)):
            if not self.reader.is_alive():
                raise AssertionError(f"ended before printing {text!r}:\n{self.stderr[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within {timeout}s:\n{self.stderr[-3000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"running after {timeout}s:\n{self.stderr[-3000:]}") from None
        self.reader.join(timeout=10)
        return code

    def kill(self) -> None:
        """The process group; workers in sessions of their own need their own kill."""
        kill_group(self.process.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)


def ctrl_c_after(run: LiveProcess, text: str, timeout: float = 180) -> int:
    """Once RUN prints TEXT, SIGINT to its whole process group (what a terminal's Ctrl-C
    does); its exit code. The group is killed whatever happens."""
    try:
        run.wait_for(text, timeout=timeout)
        os.killpg(run.process.pid, signal.SIGINT)
        return run.finish(timeout=90)
    finally:
        run.kill()


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# The modules whose tests run longest (whole jobs stopped, resumed, cut off, joined), the
# longest first. Tests are dealt to the xdist workers one at a time in this order (addopts:
# --dist loadgroup, --no-loadscope-reorder), so the long ones start first and the short ones
# fill the gaps at the end: a long test dealt last keeps one worker busy while the others
# sit idle.
LONG_MODULES = (
    "test_job_signals", "test_multinode", "test_trackers", "test_shards_train", "test_faults",
    "test_collectives", "test_custom", "test_preempt", "test_eval", "test_lr", "test_shards_remote",
    "test_loop_safety", "test_resume", "test_train", "test_curves", "test_recipe_resume",
    "test_world_change", "test_export", "test_run_folders", "test_launch", "test_check_env",
    "test_data_checks", "test_compression", "test_speed_paths", "test_compile_mode",
    "test_bench_barrier",
)  # fmt: skip

# Modules whose tests share what a module-scoped fixture made (a trained run, packed shards,
# a server): each goes to one worker whole, so the fixture is made once, not once per worker.
SHARED_FIXTURE_MODULES = (
    "test_job_signals", "test_trackers", "test_shards_train", "test_custom", "test_eval",
    "test_shards_remote", "test_loop_safety", "test_resume", "test_train", "test_curves",
    "test_export", "test_collectives",
)  # fmt: skip


# Modules whose tests mostly wait (a node that never joins, a timeout to reach, a host that
# joins later): two workers in them at once leave a core idle. Each of their tests is dealt
# after WAITING_SPREAD others (a module that shares a fixture counts as one: it goes whole to
# one worker), so that the others' computing fills the waits.
WAITING_MODULES = ("test_multinode", "test_faults")
WAITING_SPREAD = 2


def spread_waiting(items: list) -> list:
    waiting = [item for item in items if module_name(item) in WAITING_MODULES]
    spread: list = []
    dealt = 0
    for item in items:
        name = module_name(item)
        if name in WAITING_MODULES:
            continue
        previous = module_name(spread[-1]) if spread else None
        starts_a_unit = name not in SHARED_FIXTURE_MODULES or previous != name
        if starts_a_unit:
            if waiting and dealt % WAITING_SPREAD == 0:
                spread.append(waiting.pop(0))
            dealt += 1
        spread.append(item)
    return spread + waiting


def module_name(item) -> str:
    return item.module.__name__ if item.module is not None else ""


def long_first(item) -> int:
    name = module_name(item)
    return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Long modules first (a stable sort: each module's tests stay together, in order), the
    waiting ones spread among them; the modules that share fixtures grouped; tests marked
    `gpu` exist everywhere and run only where CUDA does."""
    items.sort(key=long_first)
    items[:] = spread_waiting(items)
    for item in items:
        if module_name(item) in SHARED_FIXTURE_MODULES:
            item.add_marker(pytest.mark.xdist_group(module_name(item)))
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def write_noise_folder(root: Path, per_class: int) -> None:
    """Three classes of small noise PNGs in each split (tests/test_data.py's folders hold
    at most 28 images a class)."""
    import torch
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for name in ("cat", "dog", "owl"):
            (root / split / name).mkdir(parents=True)
            for index in range(per_class):
                pixels = torch.randint(0, 256, (16, 16, 3), dtype=torch.uint8, generator=generator)
                Image.fromarray(pixels.numpy()).save(root / split / name / f"{index}.png")


def run_on_read_only_mount(folder: Path, ddpcli_args: str, timeout: float = 90):
    """`python -m ddpcli ARGS` with FOLDER a read-only tmpfs, mounted in a mount namespace of
    the command's own (needs root and unshare; the test is skipped otherwise)."""
    import shutil

    if not shutil.which("unshare") or os.geteuid() != 0:
        pytest.skip("needs unshare and root for a read-only mount")
    folder.mkdir(exist_ok=True)
    script = (
        f"mount -t tmpfs -o ro none {folder} || exit 77; "
        f"exec {sys.executable} -m ddpcli {ddpcli_args}"
    )
    result = run_bounded(["unshare", "-m", "sh", "-c", script], timeout, clean_env())
    if result.returncode == 77:
        pytest.skip("cannot mount a read-only tmpfs here")
    return result
