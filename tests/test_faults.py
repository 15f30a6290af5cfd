"""Faults and launchers, run for real: a worker killed mid-epoch (with and without
--max-restarts), a worker that raises, --log-dir, and `ddpcli train` as one worker of
torchrun-style variables, the legacy torch.distributed.launch and SLURM.

Every run has a timeout, and every fault test checks that no worker of its run is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    LiveProcess,
    clean_env,
    free_port,
    kill_group,
    popen,
    read_metrics,
    run_bounded,
    run_cli,
    write_noise_folder,
)

from ddpcli.cli import main
from ddpcli.environments import read_launcher_env

TINY = ["--cpu", "--arch", "tinycnn", "--image-size", "16"]
# 8192 images, batch 16, two ranks: 256 steps an epoch, time enough to act mid-epoch.
LONG_EPOCHS = [*TINY, "--per-gpu-batch", "16", "--synthetic-size", "8192"]
# Each of rank 1's batches 0.1 s late (a sleep), rank 0 waiting for it at the all-reduce:
# the job trains next to nothing while a test acts on it.
SLOW_RANK_1 = {"DDPCLI_SLOW_DATA": "1:0.1"}
SHORT_RUN = [*TINY, "--per-gpu-batch", "32", "--synthetic-size", "128", "--epochs", "1"]
STARTUP_S = 90  # imports and rendezvous on a busy two-core machine


# --- Processes -----------------------------------------------------------------------------


def proc_args(pid: str) -> list[str]:
    return (Path("/proc") / pid / "cmdline").read_bytes().decode(errors="replace").split("\0")


def worker_rank(pid: str) -> int | None:
    """The global rank of a ddpcli worker, else None. A forked worker names itself
    "ddpcli rank N" (its command line is its launcher's); a worker started as a program
    (`python -m ddpcli.training.worker`) carries the RANK the agent gave it in its environment."""
    name = (Path("/proc") / pid / "comm").read_text().strip()
    if name.startswith("ddpcli rank "):
        return int(name.removeprefix("ddpcli rank "))
    if "ddpcli.training.worker" not in proc_args(pid):
        return None
    environ = (Path("/proc") / pid / "environ").read_bytes().split(b"\0")
    variables = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    return int(variables[b"RANK"])


def child_workers(launcher: int) -> dict[int, int]:
    """Global rank -> pid of the workers `launcher` started: its children when they are
    programs, its fork server's when they are forked."""
    workers = {}
    for pid in descendants(launcher):
        try:
            rank = worker_rank(str(pid))
        except (OSError, ValueError, KeyError, IndexError):
            continue  # one that just ended
        if rank is not None:  # the first found, not its DataLoader workers (its name too)
            workers.setdefault(rank, pid)
    return workers


def descendants(ancestor: int) -> list[int]:
    """Children first, then grandchildren, and so on."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # one that just ended
        children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [ancestor]
    while frontier:
        found += (frontier := [c for p in frontier for c in children.get(p, [])])
    return found


def leftover_workers(out: Path) -> list[int]:
    """Workers of this test's run still alive: their command line, or (forked) the
    environment their launcher gave the fork server (conftest.tagged), names its output
    folder. (Other test sessions run workers of their own.)"""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            is_worker = worker_rank(entry.name) is not None
            args = proc_args(entry.name)
            environ = (entry / "environ").read_bytes().decode(errors="replace")
        except (OSError, ValueError, KeyError, IndexError):
            continue
        if is_worker and (any(str(out) in arg for arg in args) or str(out) in environ):
            left.append(int(entry.name))
    return left


def assert_no_worker_left(out: Path, grace_s: float = 5) -> None:
    deadline = time.monotonic() + grace_s
    while leftover_workers(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftover_workers(out)
    for pid in left:  # fail the test, but leave nothing running
        kill_pid(pid)
    assert not left, f"workers left behind: {left}"


class Background(LiveProcess):
    """`python -m ddpcli ARGS`, read as it runs. On leaving the block the launcher's
    process group and its workers (each in a session of its own) are killed."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, entry: str | None = None):
        """ENTRY: a script to run instead of `-m ddpcli`."""
        super().__init__([sys.executable, *([entry] if entry else ["-m", "ddpcli"]), *args], env)

    def wait_for(self, text: str, timeout: float = STARTUP_S) -> None:
        super().wait_for(text, timeout)

    def kill_worker(self, rank: int) -> None:
        workers = child_workers(self.process.pid)
        assert rank in workers, f"no worker of rank {rank} among {workers}"
        os.kill(workers[rank], signal.SIGKILL)

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc) -> None:
        for pid in child_workers(self.process.pid).values():
            kill_pid(pid)
        self.kill()


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's end waits for init to reap it)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def run_together(commands: list[tuple[list[str], dict]], timeout: float):
    """Start every command at once, as a launcher starts its ranks; wait with one deadline;
    kill every process group at the end, whatever happened."""
    started = [popen(command, env) for command, env in commands]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for (command, _), process in zip(commands, started, strict=True):
            left = max(1.0, deadline - time.monotonic())
            try:
                stdout, stderr = process.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"timed out after {timeout}s: {' '.join(command)}") from None
            results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    finally:
        for process in started:
            kill_group(process.pid)
            if process.poll() is None:
                process.wait(timeout=30)
    return results


# --- Dead workers --------------------------------------------------------------------------


def test_sigkill_mid_epoch_stops_every_worker_and_names_the_rank(tmp_path):
    out = tmp_path / "run"
    args = ["train", *LONG_EPOCHS, "--nproc", "2", "--epochs", "2", "--log-every", "1"]
    with Background(
        *args, "--timeout", "20", "--out", str(out), env=clean_env(**SLOW_RANK_1)
    ) as run:
        run.wait_for("epoch 1/2 step 2/")  # training, not starting up
        run.kill_worker(1)
        killed_at = time.monotonic()
        code = run.finish(timeout=60)
        stopped_after = time.monotonic() - killed_at
    assert code == 1, run.stderr[-3000:]
    # The other worker did not wait for --timeout, let alone forever.
    assert stopped_after < 20, f"{stopped_after:.1f} s: {run.stderr[-3000:]}"
    host = socket.gethostname()
    assert f"rank 1 on {host} failed first: killed by SIGKILL" in run.stderr, run.stderr[-3000:]
    assert "most likely out of memory, or the scheduler" in run.stderr
    assert "(then rank 0 stopped)" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 2
    assert_no_worker_left(out)


def test_a_killed_ranks_loader_workers_die_with_it_and_its_peers_stop_at_once(tmp_path):
    """Loader workers are forked after the process group forms, so they hold their rank's
    Gloo sockets: left alive after their rank was killed, they kept its peers waiting in a
    collective until their own check of their parent ended them (10 s in all, not 1 s)."""
    data, out = tmp_path / "folder", tmp_path / "run"
    # 72 images, batch 4, two ranks: 9 steps an epoch, each of rank 1's batches 0.5 s late
    # (a sleep, no CPU): still in epoch 1 when it is killed, on a busy machine too.
    write_noise_folder(data, per_class=24)
    args = [
        "train", *TINY, "--dataset", "imagefolder", "--data-dir", str(data), "--data-path",
        "loader", "--workers", "2", "--per-gpu-batch", "4", "--nproc", "2", "--epochs", "3",
        "--log-every", "1", "--timeout", "60", "--out", str(out),
    ]  # fmt: skip
    with Background(*args, env=clean_env(DDPCLI_SLOW_DATA="1:0.5")) as run:
        run.wait_for("epoch 1/3 step 2/")
        loader_workers = descendants(child_workers(run.process.pid)[1])
        assert len(loader_workers) == 2, loader_workers
        run.kill_worker(1)
        killed_at = time.monotonic()
        while any(map(is_running, loader_workers)) and time.monotonic() - killed_at < 4:
            time.sleep(0.05)
        orphans = [pid for pid in loader_workers if is_running(pid)]
        code = run.finish(timeout=60)
        stopped_after = time.monotonic() - killed_at
    assert not orphans, "the killed rank's loader workers outlived it"
    assert code == 1, run.stderr[-3000:]
    assert f"rank 1 on {socket.gethostname()} failed first: killed by SIGKILL" in run.stderr
    assert stopped_after < 5, f"{stopped_after:.1f} s: {run.stderr[-3000:]}"
    assert_no_worker_left(out)


# `ddpcli train` as a GPU job starts it: its workers run as programs, not forked.
AS_PROGRAMS = """
import sys
import ddpcli.launcher.engine
import ddpcli.launcher.train_launch
ddpcli.launcher.engine.forks_workers = lambda uses_gpus: False
ddpcli.launcher.train_launch.forks_workers = lambda uses_gpus: False
from ddpcli.cli import main
sys.argv[0] = "ddpcli"
main()
"""


def started_as(workers: str, folder: Path) -> str | None:
    """The entry that starts `ddpcli` with its workers WORKERS: None for the usual one."""
    if workers != "programs":
        return None
    entry = folder / "as_programs.py"
    entry.write_text(AS_PROGRAMS)
    return str(entry)


@pytest.mark.parametrize("workers", ["forked", "programs"])
def test_the_agents_sigterm_after_a_rank_died_is_no_preemption(tmp_path, workers):
    """The agent stops the survivors with the preemption signal. A survivor that cannot
    notice the dead rank (here: busy loading a batch; on GPUs: waiting in NCCL) took it as
    a preemption, printed its stack after 20 s and was killed at 30 s."""
    out = tmp_path / "run"
    args = [*SHORT_RUN, "--nproc", "2", "--timeout", "120", "--out", str(out)]
    entry = started_as(workers, tmp_path)
    env = clean_env(DDPCLI_SLOW_DATA="0:60")  # rank 0 waits a minute for each batch
    with Background("train", *args, env=env, entry=entry) as run:
        run.wait_for("strategy ddp")
        time.sleep(3)  # rank 0 is in the loop, waiting for its first batch
        run.kill_worker(1)
        killed_at = time.monotonic()
        code = run.finish(timeout=90)
        stopped_after = time.monotonic() - killed_at
    assert code == 1, run.stderr[-3000:]
    assert f"rank 1 on {socket.gethostname()} failed first: killed by SIGKILL" in run.stderr
    assert "(then rank 0 stopped)" in run.stderr
    assert "Thread 0x" not in run.stderr, "a stack dump: it waited as if preempted"
    assert stopped_after < 15, f"{stopped_after:.1f} s: {run.stderr[-3000:]}"
    assert_no_worker_left(out)


@pytest.mark.parametrize("workers", ["forked", "programs"])
def test_a_rank_stuck_outside_any_collective_is_named_with_where_it_was(tmp_path, workers):
    """Rank 1 waits a minute for each batch; rank 0 gives up at the all-reduce after
    --timeout. The agent's SIGTERM then finds rank 1 busy outside any collective, and the
    report names it as the rank rank 0 waited for, with its line. (Taken as leaving for a
    failed peer, it was reported as "failed first: exit code 1" with "NoneType: None".)"""
    out = tmp_path / "run"
    args = [*SHORT_RUN, "--nproc", "2", "--timeout", "5", "--out", str(out)]
    entry = started_as(workers, tmp_path)
    env = clean_env(DDPCLI_SLOW_DATA="1:60")
    with Background("train", *args, env=env, entry=entry) as run:
        code = run.finish(timeout=STARTUP_S + 60)
    host = socket.gethostname()
    said = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert code == 1, run.stderr[-3000:]
    expected = re.escape(
        f"error: rank 1 on {host} stopped responding: rank 0 waited for it for --timeout (5 s) "
        "at a collective and gave up; it was then stopped (SIGTERM) while still at "
        "ddpcli/data/pipeline.py:LINE in __iter__(): time.sleep(self.seconds)"
    ).replace("LINE", r"\d+")
    # Rank 0's own timeout is no news: the report's first line says it; the flight
    # recorder's verdict adds the collective rank 0 waited in, and where its records are.
    assert re.fullmatch(expected, said[0]), run.stderr[-3000:]
    assert re.fullmatch(
        r"error:   rank 0 waited in .* \(#\d+\), which rank 1 never issued \(its last was #\d+\)",
        said[1],
    ), run.stderr[-3000:]
    assert said[2].startswith(f"error:   records: {out / 'collectives'}") and len(said) == 3
    assert_no_worker_left(out)


def test_a_stopped_rank_is_named_as_unresponsive_not_out_of_memory(tmp_path):
    """SIGSTOP: the others time out at a collective after --timeout; the agent then kills the
    stopped rank (SIGKILL, as it cannot act on SIGTERM). That is not an out-of-memory kill."""
    out = tmp_path / "run"
    args = ["train", *LONG_EPOCHS, "--nproc", "2", "--epochs", "2", "--log-every", "1"]
    with Background(
        *args, "--timeout", "5", "--out", str(out), env=clean_env(**SLOW_RANK_1)
    ) as run:
        run.wait_for("epoch 1/2 step 2/")
        workers = child_workers(run.process.pid)
        os.kill(workers[1], signal.SIGSTOP)
        try:
            code = run.finish(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(workers[1], signal.SIGCONT)
    assert code == 1, run.stderr[-3000:]
    host = socket.gethostname()
    assert f"rank 1 on {host} stopped responding: rank 0 waited for it" in run.stderr, run.stderr[
        -3000:
    ]
    assert "--timeout (5 s)" in run.stderr
    assert "out of memory" not in run.stderr
    assert_no_worker_left(out)


@pytest.mark.parametrize("init", ["env", "file"])
def test_sigkill_with_max_restarts_resumes_from_last_checkpoint(tmp_path, init):
    """The restarted workers meet in the store (env://) or file (file://) the dead ones used;
    they must not read the dead ones' addresses there."""
    out, init_file = tmp_path / "run", tmp_path / "init"
    args = [
        "train", *TINY, "--per-gpu-batch", "16", "--synthetic-size", "512", "--nproc", "2",
        "--epochs", "2", "--log-every", "4", "--max-restarts", "1", "--timeout", "20",
        "--out", str(out),
    ]  # fmt: skip
    if init == "file":
        args += ["--init-method", f"file://{init_file}"]
    # 16 steps an epoch, each of rank 1's batches 0.1 s late (a sleep, no CPU): the kill at
    # step 4 of epoch 2 lands mid-epoch, with 1.2 s to spare.
    with Background(*args, env=clean_env(DDPCLI_SLOW_DATA="1:0.1")) as run:
        run.wait_for("epoch 2/2 step")  # epoch 1 and its checkpoints/last.pt are written
        run.kill_worker(1)
        code = run.finish(timeout=150)
    assert code == 0, run.stderr[-3000:]
    assert "restart 1: resuming from the last checkpoint" in run.stderr
    resumed = [line for line in run.lines if line.startswith("resumed from")]
    assert resumed and "checkpoints/last.pt at epoch 2" in resumed[0], run.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [1, 2]  # no epoch twice, none missing
    assert all(m["world_size"] == 2 for m in metrics)
    assert not init_file.exists()
    assert_no_worker_left(out)


@pytest.mark.parametrize("killed", ["group", "process"])
def test_workers_die_with_a_killed_launcher(tmp_path, killed):
    """The agent starts its workers in sessions of their own, so killing the launcher's
    process group (a scheduler, a test's timeout), or the launcher alone (the OOM killer),
    must still take them down, and the fork server they were forked from."""
    out = tmp_path / "run"
    # Ten long epochs: orphaned workers would still be training when the test looks.
    args = ["train", *LONG_EPOCHS, "--nproc", "2", "--epochs", "10", "--log-every", "1"]
    with Background(
        *args, "--timeout", "20", "--out", str(out), env=clean_env(**SLOW_RANK_1)
    ) as run:
        run.wait_for("epoch 1/10 step 2/")
        assert len(child_workers(run.process.pid)) == 2
        family = descendants(run.process.pid)  # the workers, and their fork server if forked
        if killed == "group":  # the launcher (and its fork server): not the workers' group
            kill_group(run.process.pid)
        else:
            os.kill(run.process.pid, signal.SIGKILL)
        assert run.finish(timeout=30) == -signal.SIGKILL
        assert_no_worker_left(out)
        deadline = time.monotonic() + 5
        while (alive := [pid for pid in family if is_running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in alive:
            kill_pid(pid)
        assert not alive, f"left behind: {[proc_args(str(pid)) for pid in alive]}"


def test_worker_exception_with_log_dir(tmp_path):
    """Rank 1 raises (its sample trace file is a folder); --log-dir keeps each rank's output
    in its own file, and the console shows rank 0 and rank 1's error, prefixed."""
    out, logs, trace = tmp_path / "run", tmp_path / "logs", tmp_path / "trace"
    trace.with_name("trace.rank1").mkdir()  # rank 1 cannot open it: IsADirectoryError
    result = run_cli(
        "train", *SHORT_RUN, "--nproc", "2", "--timeout", "20", "--log-dir", str(logs),
        "--out", str(out), env={"DDPCLI_TRACE_SAMPLES": str(trace)}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    host = socket.gethostname()
    assert f"rank 1 on {host} failed first: exit code 1" in result.stderr, result.stderr[-3000:]
    assert "IsADirectoryError" in result.stderr
    assert "Traceback" not in result.stderr
    assert f"[{host} rank 0] world size 2" in result.stderr  # rank 0's output, prefixed
    assert f"[{host} rank 1] error: rank 1: IsADirectoryError" in result.stderr  # any rank's errors
    (rank0,) = logs.glob("*/attempt_0/0/stderr.log")
    (rank1,) = logs.glob("*/attempt_0/1/stderr.log")
    assert "world size 2" in rank0.read_text()
    assert "IsADirectoryError" in rank1.read_text() and "world size" not in rank1.read_text()
    assert f"its output: {rank1}" in result.stderr
    assert_no_worker_left(out)


# --- Launchers -----------------------------------------------------------------------------


def train_command(out: Path) -> list[str]:
    train = [sys.executable, "-m", "ddpcli", "train", *SHORT_RUN]
    return [*train, "--timeout", "60", "--out", str(out)]


def test_torchrun_variables_make_each_process_one_worker(tmp_path):
    """What torchrun (or any launcher) sets: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.
    Two processes, one world of 2; neither starts workers of its own."""
    out, port = tmp_path / "run", str(free_port())
    commands = [
        (train_command(out), clean_env(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        ))
        for rank in (0, 1)
    ]  # fmt: skip
    results = run_together(commands, timeout=150)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-2000:]
    metrics = read_metrics(out)
    assert len(metrics) == 1 and metrics[0]["world_size"] == 2  # one world of 2, not two of 2
    assert "world size 2" in results[0].stderr
    assert "world size" not in results[1].stderr  # rank 0 speaks for the job


def test_legacy_launcher_passing_local_rank_argument(tmp_path):
    """`python -m torch.distributed.launch` without --use-env passes --local-rank=N as an
    argument (and LOCAL_RANK); `ddpcli` drops the argument and runs as that one worker."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "ddpcli", *train_command(out)[3:],
    ]  # fmt: skip
    result = run_bounded(command, timeout=180, env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 1 and metrics[0]["world_size"] == 2


def test_old_local_rank_argument_spelling_is_dropped(in_process, monkeypatch, capsys):
    """Launchers before torch 2.0 wrote --local_rank=N (the test above sees --local-rank=N).
    `ddpcli`'s main() in this process (in_process's environment; a dry run starts nothing)."""
    monkeypatch.setattr(sys, "argv", ["ddpcli", "--local_rank=1", "train", "--cpu", "--dry-run",
                                      "--json"])  # fmt: skip
    monkeypatch.setenv("LOCAL_RANK", "unset at the end")  # main() sets it: undone at the end
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exited:
        main()
    result = capsys.readouterr()
    assert exited.value.code in (0, None), result.err[-2000:]
    assert os.environ.get("LOCAL_RANK") == "1"
    assert json.loads(result.out)["world_size"] == 2


def test_slurm_variables_make_each_task_one_worker(tmp_path):
    """srun sets SLURM_PROCID/NTASKS/LOCALID/NODELIST and no MASTER_ADDR: ddpcli derives
    rank, world size and the master's address (the first host of the node list)."""
    out, port = tmp_path / "run", str(free_port())
    commands = [
        (train_command(out), clean_env(
            SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NODEID="0",
            SLURM_STEP_ID="0",  # what makes them srun's tasks (ddpcli.environments.slurm)
            SLURM_NODELIST="localhost", SLURM_TASKS_PER_NODE="2", SLURM_JOB_ID="4242",
            MASTER_PORT=port,
        ))
        for rank in (0, 1)
    ]  # fmt: skip
    results = run_together(commands, timeout=150)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-2000:]
    metrics = read_metrics(out)
    assert len(metrics) == 1 and metrics[0]["world_size"] == 2
    assert "world size 2" in results[0].stderr


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (
            {"SLURM_NODELIST": "gpu[07-08,11]", "SLURM_TASKS_PER_NODE": "4(x2),2",
             "SLURM_NODEID": "1", "SLURM_JOB_ID": "123456"},
            {"master_addr": "gpu07", "local_world_size": 4, "node_rank": 1, "master_port": 18456},
        ),
        (
            {"SLURM_NODELIST": "node[1-2]-ib,login1", "SLURM_NTASKS_PER_NODE": "8",
             "MASTER_PORT": "29400"},
            {"master_addr": "node1-ib", "local_world_size": 8, "master_port": 29400},
        ),
        (
            {"SLURM_JOB_NODELIST": "a01,a02", "MASTER_ADDR": "10.0.0.7"},
            {"master_addr": "10.0.0.7", "local_world_size": 1, "master_port": 29500},
        ),
        ({}, {"master_addr": "127.0.0.1"}),
    ],
)  # fmt: skip
def test_slurm_variables_resolve(variables, expected):
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "10", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
        **variables,
    }  # fmt: skip
    launcher = read_launcher_env(env)
    assert (launcher.rank, launcher.world_size, launcher.local_rank) == (5, 10, 1)
    assert launcher.launcher == "slurm"
    for name, value in expected.items():
        assert getattr(launcher, name) == value, name


def test_one_slurm_task_is_no_launcher():
    """A batch script's own shell has SLURM_PROCID=0 too; with one task ddpcli launches."""
    assert read_launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_a_rank_that_cannot_record_its_error_still_reports_one_line(monkeypatch, capsys):
    """A full disk while a rank records its traceback for the agent: no second stack."""
    from ddpcli.training.worker import record_for_agent

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "/dev/full")  # every write: ENOSPC
    try:
        raise ValueError("the original failure")
    except ValueError as error:
        record_for_agent(error)
    assert "Traceback" not in capsys.readouterr().err
