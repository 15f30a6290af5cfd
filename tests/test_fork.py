"""Forked workers (ddpcli/launcher/fork.py): forked from a fork server that has no other thread (a
child forked from the multi-threaded launcher could inherit a C library lock held for
good), and elastic's function path made to behave as its program path does: each worker
named, with the job's environment, stopped by SIGTERM as a program would be, and every
failed rank reported, not only the first."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic import multiprocessing as elastic_mp
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from ddpcli.launcher.fork import (
    fork_server,
    fork_server_pid,
    forks_workers,
    function_path_fixed,
    start_forked_worker,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux only")


@pytest.fixture
def server_imports_this_module(monkeypatch):
    """The fork server (a new interpreter) finds this module on PYTHONPATH, and preloads it
    (torch with it) once, as a launch's server preloads its worker module: Python before 3.12
    does not hand the server the launcher's sys.path, and each forked worker imported torch
    again on its own (seconds of CPU each)."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    )


def main(argv: list[str]) -> None:
    """A forked worker's entry (start_forked_worker imports this module): leave what it saw
    of itself and its parent in a file, then exit with a code after a delay."""
    _, record, code, delay_s = argv
    parent = os.getppid()
    seen = {
        "name": Path("/proc/self/comm").read_text().strip(),
        "parent": parent,
        "parent_threads": len(os.listdir(f"/proc/{parent}/task")),
        "job_variable": os.environ.get("DDPCLI_TEST_JOB_VARIABLE"),
        "temp_dir": multiprocessing.util.get_temp_dir(),
        "collects_garbage": gc.isenabled(),  # the server imported without the collector
    }
    Path(record).write_text(json.dumps(seen))
    time.sleep(float(delay_s))
    if code != "return":  # else back to elastic, which waits for the agent's word to exit
        os._exit(int(code))


def failed_ranks(server: str, folder: Path) -> dict[int, int]:
    """Rank 0 fails after 2 s with exit code 3; rank 1 is still running then, and is stopped."""
    folder.mkdir()
    job_env = {"DDPCLI_TEST_JOB_VARIABLE": "set after the server started"}
    context = elastic_mp.start_processes(
        name="fork-test",
        entrypoint=start_forked_worker,
        args={
            rank: (server, job_env, __name__, str(folder / f"seen-{rank}"), code, delay)
            for rank, code, delay in ((0, "3", "2"), (1, "0", "60"))
        },  # fmt: skip
        envs={rank: {"RANK": str(rank)} for rank in (0, 1)},
        logs_specs=DefaultLogsSpecs(log_dir=str(folder)),
        start_method="forkserver",
    )
    result = context.wait(timeout=60, period=0.1)
    assert result is not None and result.is_failed()
    seen = [json.loads((folder / f"seen-{rank}").read_text()) for rank in (0, 1)]
    assert [s["name"] for s in seen] == ["ddpcli rank 0", "ddpcli rank 1"]  # what ps shows
    assert all(s["parent"] == int(server) for s in seen)  # not the launcher: the server
    assert all(s["parent_threads"] == 1 for s in seen)  # nothing held a lock as it forked
    assert all(s["collects_garbage"] for s in seen)
    assert all(s["job_variable"] == job_env["DDPCLI_TEST_JOB_VARIABLE"] for s in seen)
    # Each its own: the launcher's is removed as it exits, maybe before a worker's child.
    launchers = multiprocessing.util.get_temp_dir()
    assert len({launchers, seen[0]["temp_dir"], seen[1]["temp_dir"]}) == 3
    return {rank: failure.exitcode for rank, failure in result.failures.items()}


@linux_only
def test_every_failed_rank_is_reported_not_only_the_first(tmp_path, server_imports_this_module):
    """Elastic's own function path, then the fixed one, their workers forked from one server
    (it imports torch once: seconds of CPU)."""
    original = elastic_mp.MultiprocessContext
    with fork_server(__name__) as server:
        assert failed_ranks(server, tmp_path / "plain") == {0: 3}  # elastic's own path
        with function_path_fixed():
            assert failed_ranks(server, tmp_path / "patched") == {0: 3, 1: -signal.SIGTERM}
        assert elastic_mp.MultiprocessContext is original
    assert fork_server_pid() is None  # stopped with the launch: the next one starts afresh
    with pytest.raises(ProcessLookupError):
        os.kill(int(server), 0)


@linux_only
def test_a_worker_killed_as_it_finishes_does_not_hang_the_launcher(
    tmp_path, server_imports_this_module
):
    """Both workers returned and wait for the agent's word to exit; one is killed there.
    multiprocessing's Event.set() would then wait for it forever: the job hung after a
    preemption when a rank was killed as it finished."""
    records = [tmp_path / f"seen-{rank}" for rank in (0, 1)]
    with fork_server(__name__) as server, function_path_fixed():
        context = elastic_mp.start_processes(
            name="fork-test",
            entrypoint=start_forked_worker,
            args={
                rank: (server, {}, __name__, str(records[rank]), "return", "0") for rank in (0, 1)
            },
            envs={rank: {"RANK": str(rank)} for rank in (0, 1)},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
            start_method="forkserver",
        )
        workers = context.pids()
        try:
            deadline = time.monotonic() + 60
            while not all(r.exists() for r in records) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # both now wait for the word
            os.kill(workers[1], signal.SIGKILL)
            said = threading.Thread(target=context._worker_finished_event.set, daemon=True)
            said.start()
            said.join(timeout=10)
            assert not said.is_alive(), "the agent's word waited for a killed worker"
            result = context.wait(timeout=30, period=0.1)
        finally:
            for pid in workers.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert result is not None
    exits = {r: f.exitcode for r, f in result.failures.items()}
    # Rank 0 exits on the word by itself; where the context's poll finds rank 1 dead first,
    # its own clean-up stops rank 0 (SIGTERM), which is no failure of the launcher.
    assert exits in ({1: -signal.SIGKILL}, {0: -signal.SIGTERM, 1: -signal.SIGKILL}), exits


LAUNCHER_BEFORE_TORCH = """
import json, os, sys, time
from ddpcli.launcher.fork import fork_server, function_path_fixed, start_forked_worker
assert "torch" not in sys.modules
with fork_server("test_fork") as server:
    from torch.distributed.elastic import multiprocessing as elastic_mp
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    folder = sys.argv[1]
    with function_path_fixed():
        context = elastic_mp.start_processes(
            name="fork-test", entrypoint=start_forked_worker,
            args={0: (server, {}, "test_fork", folder + "/seen-0", "3", "0")},
            envs={0: {"RANK": "0"}}, logs_specs=DefaultLogsSpecs(log_dir=folder),
            start_method="forkserver")
        result = context.wait(timeout=60, period=0.1)
    server_command = open(f"/proc/{server}/cmdline").read()
    print(json.dumps({
        "server": int(server),
        "server_is_a_fork": server_command == open("/proc/self/cmdline").read(),
        "exit_codes": {r: f.exitcode for r, f in result.failures.items()},
    }), flush=True)
    time.sleep(300)
"""


def ended(pid: int) -> bool:
    """Gone, or a zombie whose parent (the killed launcher) can no longer reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@linux_only
def test_a_launcher_that_has_not_imported_torch_forks_its_server(
    tmp_path, server_imports_this_module
):
    """The server is forked from the launcher once it has imported torch (one import, not
    two: seconds of CPU per launch); its workers run and report as before, and it still ends
    with its launcher, killed (its "alive" pipe's other end is not its own)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_BEFORE_TORCH, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        said = json.loads(launcher.stdout.readline() or "null")
        assert said is not None, launcher.communicate(timeout=10)[1]
        assert said["server_is_a_fork"]  # not `python -c "from multiprocessing.forkserver..."`
        assert said["exit_codes"] == {"0": 3}
        seen = json.loads((tmp_path / "seen-0").read_text())
        assert seen["name"] == "ddpcli rank 0" and seen["parent"] == said["server"]
        assert seen["parent_threads"] == 1 and seen["collects_garbage"]
        launcher.kill()
        _, errors = launcher.communicate(timeout=10)
        deadline = time.monotonic() + 10
        while not ended(said["server"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended(said["server"]), "the forked server outlived its launcher"
        assert "died unexpectedly" not in errors, errors  # the resource tracker, as before
    finally:
        launcher.kill()
        launcher.wait(timeout=10)


@linux_only
def test_an_inner_use_of_the_fork_server_leaves_it_to_the_outer_one():
    with fork_server(__name__) as outer:
        with fork_server(__name__) as inner:
            assert inner == outer
        os.kill(int(outer), 0)  # still running
    assert fork_server_pid() is None


def test_only_cpu_jobs_on_linux_fork():
    assert forks_workers(uses_gpus=False) == sys.platform.startswith("linux")
    assert not forks_workers(uses_gpus=True)


TORCH_NOTED_UNUSED = """
import json, torch
from ddpcli.launcher import fork
before_noted = fork.torch_unused_since_noted()
fork.note_torch_unused()
noted = fork.torch_unused_since_noted()
torch.set_num_threads(2)
a = torch.randn(512, 512)
a @ a  # a parallel region: OpenMP's threads stay
print(json.dumps([before_noted, noted, fork.torch_unused_since_noted()]))
"""


@linux_only
def test_torch_noted_unused_lets_the_server_fork_until_a_parallel_region_ran():
    """A process that imported torch and ran nothing of it (the tests' zygote, a launcher
    right after its import) may fork its server; torch imported without that note, or a
    parallel region since (its threads, which a forked child would wait for forever), may not."""
    said = subprocess.run(
        [sys.executable, "-c", TORCH_NOTED_UNUSED], capture_output=True, text=True, timeout=120
    )
    assert said.returncode == 0, said.stderr
    assert json.loads(said.stdout) == [False, True, False]
