"""`ddpcli launch` run for real on the CPU with Gloo: a user's script (and a module) as one
world of 2 under ddpcli's and torchrun's flag spellings; the three classic failures (an
exception on rank 1, rank 1 killed by SIGKILL, rank 1 stuck outside a collective) each give
exit 1 naming rank 1 and leave no process; what the machine can tell is refused with exit 2
before any worker starts; Ctrl-C gives one line and exit 130.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import REPO, LiveProcess, clean_env, free_port, run_bounded, run_cli, tagged
from test_faults import is_running

STARTUP_S = 90  # imports and rendezvous on a busy two-core machine

ALL_REDUCE = """
    import os, sys
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()}/{dist.get_world_size()} local {os.environ['LOCAL_RANK']} "
          f"of {os.environ['LOCAL_WORLD_SIZE']} sum {total.item():g} args {sys.argv[1:]}",
          flush=True)
    dist.destroy_process_group()
"""
FAILURES = {
    "exception": """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("bad batch on rank 1")
        dist.barrier()
    """,
    "sigkill": """
        import os, signal
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    """,
    "stuck": """
        import datetime, time
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
        if dist.get_rank() == 1:
            time.sleep(600)  # never reaches the barrier rank 0 waits in
        dist.barrier()
    """,
}
EXPECTED = {
    "exception": ["rank 1 on {host} failed first: exit code 1", "ValueError: bad batch on rank 1"],
    "sigkill": ["rank 1 on {host} failed first: killed by SIGKILL"],
    "stuck": [
        "rank 1 on {host} stopped responding: rank 0 waited for it",
        # From the stack it wrote when stopped (the script's line 6: textwrap keeps line 1)
        "stopped (SIGTERM) while still at ",
        "stuck.py:6 in <module>(): time.sleep(600)",
    ],
}
# What rank 0, which only waited for rank 1 at the script's dist.barrier() (line 6, 7, 7),
# says instead of a traceback: after rank 1's exception or death, if it fails before the
# agent stops it (a race).
SURVIVOR_SAYS = {
    "exception": "lost its connection to another rank at {script}:6 in <module>(): ",
    "sigkill": "lost its connection to another rank at {script}:7 in <module>(): ",
    "stuck": "gave up waiting for another rank at {script}:7 in <module>(): ",
}


def write_script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def processes_running(marker: str) -> list[int]:
    """Processes whose command line names MARKER (a test's own script path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(marker in arg for arg in args) and not is_pytest(args):
            found.append(int(entry.name))
    return found


def is_pytest(args: list[str]) -> bool:
    """This test run itself (`python -m pytest`, `pytest`), not a process whose arguments
    merely hold a path under pytest's temporary folder."""
    return any(Path(arg).name in ("pytest", "py.test") for arg in args[:3])


def assert_none_left(marker: str, grace_s: float = 5) -> None:
    deadline = time.monotonic() + grace_s
    while processes_running(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_running(marker), f"left behind: {processes_running(marker)}"


def reported_ranks(stdout: str) -> list[str]:
    # Found anywhere, not per line: two ranks writing one pipe may interleave a line's text
    # and its newline (as under torchrun).
    return sorted(re.findall(r"rank \d/\d(?= local \d of \d sum 1 )", stdout))


def test_a_script_runs_as_one_world_of_two(tmp_path):
    script = write_script(tmp_path, "all_reduce.py", ALL_REDUCE)
    result = run_cli("launch", "--nproc", "2", str(script), "--lr", "0.1", "-x", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert reported_ranks(result.stdout) == ["rank 0/2", "rank 1/2"], result.stdout
    assert "of 2 sum 1 args ['--lr', '0.1', '-x']" in result.stdout  # the script's, untouched
    assert_none_left(str(script))


@pytest.mark.parametrize(
    "flags",
    [["--nproc-per-node=2", "--standalone"], ["--nproc_per_node", "2"]],
    ids=["torchrun-dashes", "torchrun-underscores"],
)
def test_torchrun_spellings_launch_the_same_world(tmp_path, in_process, monkeypatch, flags):
    """What torchrun's spellings start is what --nproc 2 starts (run for real above, and
    with --standalone in test_torchrun_flags_run_a_script_and_standalone_keeps_its_port)."""
    launched = []
    monkeypatch.setattr(
        "ddpcli.launcher.script_launch.launch_script", lambda cfg, debug: launched.append(cfg)
    )
    write_script(tmp_path, "all_reduce.py", ALL_REDUCE)
    for given in (["--nproc", "2"], flags):
        result = in_process("launch", *given, "all_reduce.py", "--lr", "0.1", "-x", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    ours, torchruns = launched
    assert torchruns.nproc_per_node == ours.nproc_per_node == 2
    assert torchruns.script_args == ours.script_args == ["--lr", "0.1", "-x"]


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failing_script_names_the_rank_that_failed_first(tmp_path, failure):
    script = write_script(tmp_path, f"{failure}.py", FAILURES[failure])
    result = run_cli("launch", "--nproc", "2", str(script), timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    summary = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    host = socket.gethostname()
    for expected in EXPECTED[failure]:
        assert any(expected.format(host=host) in line for line in summary), result.stderr[-3000:]
    assert "rank 0 on" not in result.stderr  # the rank that only lost its peer is not blamed
    assert "SignalException" not in result.stderr and "ChildFailedError" not in result.stderr
    # Only rank 1's own exception is a traceback; rank 0's consequence is a line at most.
    tracebacks = result.stderr.count("Traceback (most recent call last)")
    assert tracebacks == (1 if failure == "exception" else 0), result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("rank 0 ")]
    at = "rank 0 " + SURVIVOR_SAYS[failure].format(script=script) + "dist.barrier() ("
    assert all(line.startswith(at) for line in said), said
    assert said or failure != "stuck", result.stderr[-3000:]  # there it times out for sure
    assert "Current thread" not in result.stderr  # stacks go to the report, not the screen
    assert_none_left(str(script))


LOADER_THEN_SIGKILL = """
    import os, signal
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    loader = torch.utils.data.DataLoader(torch.arange(10_000), batch_size=4, num_workers=2)
    for step, batch in enumerate(loader):
        if dist.get_rank() == 1 and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(batch.float())
"""


def test_a_killed_ranks_dataloader_workers_do_not_outlive_the_job(tmp_path):
    """They hold copies of the rank's sockets, and torch's own check of their parent
    comes every 5 s: the agent kills the dead rank's process group as it notices."""
    script = write_script(tmp_path, "loader_sigkill.py", LOADER_THEN_SIGKILL)
    command = [sys.executable, "-m", "ddpcli", "launch", "--nproc", "2", str(script)]
    # Output to a file, not a pipe: run_cli would wait for an orphan holding the pipe.
    with open(tmp_path / "stderr", "w+") as stderr:
        code = subprocess.run(
            command, stdout=subprocess.DEVNULL, stderr=stderr, env=tagged(clean_env(), command),
            cwd=REPO, timeout=180, start_new_session=True,
        ).returncode  # fmt: skip
        left = running_with(str(script))
        stderr.seek(0)
        output = stderr.read()
    assert code == 1, output[-3000:]
    assert f"rank 1 on {socket.gethostname()} failed first: killed by SIGKILL" in output
    assert not left, "DataLoader workers outlived the job"


def running_with(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment names MARKER: run_cli tags the
    launcher's, and every process of its job inherits it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        pid = int(entry.name)
        if marker in environ and pid != os.getpid() and is_running(pid):
            found.append(pid)
    return found


def stopped_in_mid_write(fd: int) -> None:
    """The end of the process (a SIGTERM) after part of the file is written, before the rest."""
    raise SystemExit(143)


@pytest.mark.parametrize("write", ["whole", "stopped in mid-write"])
def test_a_rank_leaves_its_error_file_whole_or_not_at_all(tmp_path, monkeypatch, write):
    """After the first failure the agent stops the other ranks and parses each one's error
    file: a cut file made it raise JSONDecodeError instead of naming the rank (seen in CI)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddpcli import files
    from ddpcli.process import record_for_agent

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    if write != "whole":
        monkeypatch.setattr(files.os, "fsync", stopped_in_mid_write)
    try:
        raise ValueError("bad batch")
    except ValueError as error:
        with pytest.raises(SystemExit) if write != "whole" else contextlib.nullcontext():
            record_for_agent(error)
    monkeypatch.undo()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    if write == "whole":
        assert failure.message["message"] == "ValueError: bad batch"
        assert 'raise ValueError("bad batch")' in failure.message["extraInfo"]["py_callstack"]
    else:
        assert not error_file.exists()  # the agent reports the signal, not a parse error
        assert failure.error_file_data["errorTraits"]["category"] == "system_terminated_error"
    assert list(tmp_path.iterdir()) == ([error_file] if write == "whole" else [])


def test_an_error_recorded_outside_its_except_block_keeps_its_words(tmp_path, monkeypatch):
    """A rank's watcher thread records a made-up error (leaving for a failed peer): elastic's
    own handler wrote sys.exc_info()'s "NoneType: None" for it, and the report lost it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddpcli.process import record_for_agent

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    record_for_agent(RuntimeError("stopped because another rank failed"))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    callstack = failure.message["extraInfo"]["py_callstack"]
    assert callstack.strip() == "RuntimeError: stopped because another rank failed"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py"], "invalid SCRIPT: missing.py does not exist"),
        (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
        (["--ifname", "nosuchif0", "x.py"], "invalid --ifname: interface 'nosuchif0' does not"),
        (["--gpus", "63", "x.py"], "invalid --gpus: GPU 63 does not exist"),
        (["--nnodes", "2", "--node-rank", "2", "x.py"], "invalid --node-rank: 2 must be below"),
        (["--nproc", "two", "x.py"], "invalid --nproc: give auto, gpu, cpu or a number"),
        (["--nnodes", "3:2", "x.py"], "invalid --nnodes: MIN:MAX needs 1 <= MIN <= MAX"),
    ],
)
def test_bad_input_is_refused_before_any_worker_starts(tmp_path, in_process, args, message):
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    result = in_process("launch", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "must not run" not in result.stderr


def test_a_taken_master_port_is_refused(tmp_path, in_process):
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = in_process("launch", "--master-port", str(port), "x.py", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"invalid --master-port: {port} is in use" in result.stderr


def test_ctrl_c_prints_one_line_exits_130_and_leaves_nothing(tmp_path):
    script = write_script(
        tmp_path,
        "forever.py",
        """
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("training", flush=True)
        while True:
            dist.barrier()
            time.sleep(0.05)
        """,
    )
    command = [sys.executable, "-m", "ddpcli", "launch", "--nproc", "2", str(script)]
    run = LiveProcess(command, clean_env(PYTHONUNBUFFERED="1"))
    try:
        # stdout is not read: wait until both workers are up, then press Ctrl-C.
        deadline = time.monotonic() + STARTUP_S
        while len(processes_running(str(script))) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # in the loop, past the rendezvous
        run.process.send_signal(signal.SIGINT)  # the terminal signals the foreground group
        code = run.finish(timeout=60)
    finally:
        run.kill()
    assert code == 130, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: interrupted (Ctrl-C): stopped the 2 worker(s)"), lines
    assert_none_left(str(script))


def test_ctrl_c_names_a_rank_stuck_where_python_cannot_stop_it_and_a_second_ends_it(tmp_path):
    """Rank 0 waits in init_process_group for rank 1, still in its own Python code. Ctrl-C
    ends rank 1 at once; rank 0 waits on inside torch's native wait, where no KeyboardInterrupt
    reaches it. It is named within seconds, and a second Ctrl-C ends it, instead of the
    agent's kill at the end of its 30 s grace."""
    script = write_script(
        tmp_path,
        "late.py",
        """
        import os, sys, time
        import torch.distributed as dist
        print(f"rank {os.environ['RANK']} in", file=sys.stderr, flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(120)
        dist.init_process_group("gloo")
        """,
    )
    command = [sys.executable, "-m", "ddpcli", "launch", "--nproc", "2", str(script)]
    run = LiveProcess(command, clean_env(PYTHONUNBUFFERED="1"))
    try:
        run.wait_for("rank 0 in", timeout=STARTUP_S)
        run.wait_for("rank 1 in", timeout=STARTUP_S)
        time.sleep(2)  # rank 0 inside init's wait
        run.process.send_signal(signal.SIGINT)
        run.wait_for("still running", timeout=20)
        run.process.send_signal(signal.SIGINT)
        code = run.finish(timeout=15)
    finally:
        run.kill()
    assert code == 130, run.stderr[-3000:]
    assert "rank(s) 0 still running 3 s after Ctrl-C" in run.stderr, run.stderr[-3000:]
    assert "Ctrl-C again ends them now" in run.stderr
    assert_none_left(str(script))


def test_the_rendezvous_keep_alive_stopped_in_its_own_thread_ends_without_an_error():
    """What the cyclic collector does now and then after a Ctrl-C (the agent left its
    rendezvous open): the keep-alive timer's finalizer runs in the timer's own thread."""
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    from ddpcli.launcher.engine import keep_alive_timers_stopped

    errors: list[BaseException | None] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda failed: errors.append(failed.exc_value)
    try:
        with keep_alive_timers_stopped():
            timer = _PeriodicTimer(timedelta(seconds=0.01), lambda: timer.cancel())
            timer.start()
        timer._thread.join(timeout=10)
    finally:
        threading.excepthook = previous_hook
    assert not timer._thread.is_alive()
    assert errors == []


def test_a_keep_alive_timer_left_running_by_a_stopped_agent_ends_with_the_launch():
    """An agent stopped by a signal leaves its rendezvous open and its keep-alive timer
    running, which torch never stops: alive at exit, a heartbeat returning from C++ then
    aborted the launcher after its last line. The one caught mid-heartbeat finishes it."""
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    from ddpcli.launcher.engine import keep_alive_timers_stopped

    beats: list[float] = []
    heartbeat_started = threading.Event()

    def heartbeat() -> None:
        heartbeat_started.set()
        time.sleep(0.3)
        beats.append(time.monotonic())

    with keep_alive_timers_stopped():
        idle = _PeriodicTimer(timedelta(seconds=60), lambda: None)
        idle.start()
        busy = _PeriodicTimer(timedelta(seconds=0.01), heartbeat)
        busy.start()
        assert heartbeat_started.wait(timeout=10)
    block_ended = time.monotonic()
    assert not idle._thread.is_alive() and not busy._thread.is_alive()
    assert beats and beats[-1] <= block_ended  # the heartbeat under way finished first


def test_elastic_membership_and_a_pods_variables_reach_the_workers(tmp_path):
    """`--nnodes 1:2` on the c10d rendezvous, its endpoint and the process count from a pod's
    PET_* variables: one host comes, and after the last call it runs as a world of 2."""
    write_script(
        tmp_path,
        "world.py",
        """
        import os
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
        """,
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        "PYTHONPATH": str(REPO), "PET_NPROC_PER_NODE": "2", "PET_NNODES": "1:2",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}", "RANK": "0", "WORLD_SIZE": "2",
    }  # fmt: skip
    result = run_cli("launch", "--timeout", "30", "world.py", env=env, timeout=90, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 of 2" in result.stdout + result.stderr


@pytest.mark.parametrize(("given", "expected"), [("auto", None), ("gpu", None), ("3", 3)])
def test_torchrun_nproc_per_node_words_are_taken(given, expected):
    from ddpcli.config.launch import build_launch_config

    cfg = build_launch_config({"nproc": given, "target": "train.py"}, environ={})
    assert cfg.nproc == expected  # None: ddpcli's default, one per GPU, else 2


def test_nproc_per_node_cpu_is_one_per_core_and_a_word_it_lacks_exits_2():
    from ddpcli.config.launch import build_launch_config
    from ddpcli.errors import DdpcliError

    cfg = build_launch_config({"nproc": "cpu", "target": "train.py"}, environ={})
    assert cfg.nproc == (os.cpu_count() or 1)
    with pytest.raises(DdpcliError, match="invalid --nproc: give auto, gpu, cpu") as error:
        build_launch_config({"nproc": "many", "target": "train.py"}, environ={})
    assert error.value.exit_code == 2


def test_a_workers_line_names_its_rank_once():
    """The train and bench-barrier workers prefix their error line with their rank unless the
    message already begins with one (a failed group join: "rank 0: rank 0: could not ...")."""
    from ddpcli.errors import said_by_rank

    assert said_by_rank(2, "rank 2: could not join the process group") == (
        "rank 2: could not join the process group"
    )
    assert said_by_rank(2, "MASTER_ADDR must be set") == "rank 2: MASTER_ADDR must be set"


TWO_NODES_RANK_2_FAILS = """
    import datetime, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if dist.get_rank() == 2:
        raise ValueError("bad batch on rank 2")
    if dist.get_rank() == 1:
        time.sleep(600)
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=2)  # sees rank 2 go at once
    dist.barrier()
"""


def test_a_node_without_the_cause_says_where_its_stopped_ranks_were(tmp_path):
    """Two nodes on this machine. Node 1's rank 2 raises; node 0 only suffers: rank 0 loses
    its connection, the agent stops rank 1 (SIGTERM, busy in its own code), and the report
    says where rank 1 was, from the stack it wrote then."""
    script = write_script(tmp_path, "two_nodes.py", TWO_NODES_RANK_2_FAILS)
    port = str(free_port())
    base = [sys.executable, "-m", "ddpcli", "launch", "--nnodes", "2", "--nproc", "2"]
    where = ["--master-addr", "127.0.0.1", "--master-port", port, str(script)]
    commands = [[*base, "--node-rank", str(node), *where] for node in (0, 1)]
    started = [LiveProcess(command, clean_env()) for command in commands]
    try:
        codes = [node.finish(timeout=STARTUP_S + 60) for node in started]
    finally:
        for node in started:
            node.kill()
    node0, node1 = (node.stderr for node in started)
    assert codes == [1, 1], node0[-2000:] + node1[-2000:]
    assert f"rank 2 on {socket.gethostname()} failed first: exit code 1" in node1, node1[-2000:]
    assert f"rank 2 on {socket.gethostname()}" not in node0, node0[-2000:]
    stopped_at = f"error:   when stopped, rank 1 was at {script}:8 in <module>(): time.sleep(600)"
    assert stopped_at in node0.splitlines(), node0[-2000:]
    assert "Current thread" not in node0 + node1  # no stack on the screen


FAILS_TWICE = """
    import os
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if dist.get_rank() == 1 and attempt < 2:
        raise ValueError(f"attempt {attempt} fails")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {dist.get_rank()} sum {total.item():g}", flush=True)
"""


def test_restarted_workers_meet_again_and_a_finished_script_exits_0(tmp_path):
    """--max-restarts 2, rank 1 fails twice. The restarted Gloo ranks read the dead ranks'
    addresses from the store elastic lends them (pytorch#135712) and failed to connect in
    about 1 restart of 3; with a store per round they meet. The script never destroys its
    process group: the bootstrap does, else a rank 0 hosting the store can abort at exit."""
    script = write_script(tmp_path, "fails_twice.py", FAILS_TWICE)
    result = run_cli("launch", "--nproc", "2", "--max-restarts", "2", str(script), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    said = sorted(re.findall(r"attempt \d rank \d sum \d", result.stdout))
    assert said == ["attempt 2 rank 0 sum 2", "attempt 2 rank 1 sum 2"], result.stdout
    assert "terminate called" not in result.stderr
    assert_none_left(str(script))


# --- torchrun's other flags (34.21) ---------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--no-python"], "--no-python"),
        (["--no_python"], "--no-python"),
        (["--logs-specs", "mine"], "--logs-specs"),
        (["--numa-binding=node"], "--numa-binding"),
    ],
)
def test_torchrun_flags_it_does_not_support_are_named_as_such(tmp_path, in_process, flags, named):
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    result = in_process("launch", "--nproc", "2", *flags, "x.py", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{named} is a torchrun flag that ddpcli launch does not support" in result.stderr
    assert "invalid SCRIPT" not in result.stderr and "must not run" not in result.stderr


def test_an_unknown_flag_before_the_script_is_named(tmp_path, in_process):
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    result = in_process("launch", "--nproc", "2", "--bogus", "x.py", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "no such option: --bogus" in result.stderr
    assert "invalid SCRIPT" not in result.stderr


def test_torchrun_flags_that_make_sense_are_taken():
    from torch.distributed.elastic.multiprocessing import Std

    from ddpcli.config.launch import build_launch_config
    from ddpcli.launcher.engine import launch_config
    from ddpcli.launcher.script_launch import script_job

    flags = {
        "target": "train.py", "nproc": "2", "rdzv_conf": "timeout=40,read_timeout=70",
        "redirects": "3", "tee": "0:3,1:2", "log_dir": "logs", "local_ranks_filter": "0",
        "monitor_interval": 0.5, "role": "trainer", "start_method": "fork", "run_path": True,
        "local_addr": "10.0.0.7",
    }  # fmt: skip
    cfg = build_launch_config(flags, environ={})
    assert cfg.timeout == 40  # torchrun's rendezvous timeout is ddpcli's --timeout
    config = launch_config(script_job(cfg), "scratch")
    assert config.rdzv_configs["timeout"] == 40 and config.rdzv_configs["read_timeout"] == 70
    assert (config.monitor_interval, config.role, config.local_addr) == (0.5, "trainer", "10.0.0.7")
    logs = config.logs_specs
    assert logs._redirects == Std.ALL and logs._local_ranks_filter == {0}
    assert logs._tee == {0: Std.ALL, 1: Std.ERR}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"redirects": "5"}, "invalid --redirects: give 0, 1, 2 or 3"),
        ({"tee": "3"}, "invalid --tee: it writes the output to files in --log-dir DIR"),
        ({"rdzv_conf": "timeout"}, "invalid --rdzv-conf: give KEY=VALUE,..."),
        ({"rdzv_conf": "colour=red"}, "invalid --rdzv-conf: colour is not a setting"),
        ({"start_method": "thread"}, "invalid --start-method"),
        ({"local_ranks_filter": "a"}, "invalid --local-ranks-filter"),
    ],
)
def test_torchrun_flag_values_it_cannot_take_exit_2(flags, message):
    from ddpcli.config.launch import build_launch_config
    from ddpcli.errors import DdpcliError

    with pytest.raises(DdpcliError, match=re.escape(message)) as error:
        build_launch_config({"target": "train.py", **flags}, environ={})
    assert error.value.exit_code == 2


PRINTS_ITS_PORT = """
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} port {os.environ['MASTER_PORT']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
"""


def test_torchrun_flags_run_a_script_and_standalone_keeps_its_port(tmp_path):
    """--redirects/--tee into --log-dir, --local-ranks-filter on the console, and the flags
    that change nothing a script sees (34.21); --standalone --master-port P meets on P (34.28)."""
    script = write_script(tmp_path, "port.py", PRINTS_ITS_PORT)
    port = free_port()
    flags = [
        "--nproc-per-node", "2", "--standalone", "--master-port", str(port),
        "--log-dir", str(tmp_path / "logs"), "--redirects", "3", "--tee", "3",
        "--local-ranks-filter", "0", "--monitor-interval", "0.2", "--role", "trainer",
        "--start-method", "spawn", "--run-path", "--rdzv-conf", "join_timeout=60",
    ]  # fmt: skip
    result = run_cli("launch", *flags, str(script), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"rank 0 port {port}" in result.stdout and "rank 1 port" not in result.stdout
    logs = {path.parent.name: path.read_text() for path in tmp_path.glob("logs/*/*/*/stdout.log")}
    assert f"rank 1 port {port}" in logs["1"], logs


def test_standalone_with_a_taken_master_port_is_refused(tmp_path, in_process):
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = in_process(
            "launch", "--standalone", "--master-port", str(port), "x.py", cwd=tmp_path
        )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"invalid --master-port: {port} is in use" in result.stderr


# --- a rank that ends early (34.22) ---------------------------------------------------------

ENDS_EARLY = """
    import sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        sys.exit(0)
    dist.barrier()
"""


def test_a_rank_that_ends_early_is_named_not_another_node(tmp_path):
    script = write_script(tmp_path, "ends_early.py", ENDS_EARLY)
    result = run_cli("launch", "--nproc", "2", str(script), timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    summary = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    host = socket.gethostname()
    assert summary[0].startswith(f"error: rank 1 on {host} ended early: its script finished")
    assert f"rank 0 lost its connection to it at {script}:7 in <module>(): dist.barrier()" in (
        "\n".join(summary)
    ), summary
    assert "another node" not in result.stderr
    assert "distributed_c10d.py" not in "\n".join(summary)  # no torch frames
    assert_none_left(str(script))


# --- --log-dir checked first (34.23) --------------------------------------------------------


@pytest.mark.parametrize("log_dir", ["x.py", "x.py/logs"])
def test_a_log_dir_that_cannot_be_written_exits_2(tmp_path, in_process, log_dir):
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    result = in_process("launch", "--nproc", "2", "--log-dir", log_dir, "x.py", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"invalid --log-dir: cannot write in {log_dir}: x.py is a file" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_log_dir_on_a_read_only_file_system_exits_2(tmp_path):
    from conftest import run_on_read_only_mount

    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    folder = tmp_path / "ro"
    result = run_on_read_only_mount(
        folder, f"launch --nproc 2 --log-dir {folder}/logs {tmp_path}/x.py"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"invalid --log-dir: cannot write in {folder}/logs" in result.stderr
    assert "read-only file system" in result.stderr


# --- restarts in words (34.26) --------------------------------------------------------------

ALWAYS_FAILS = """
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo")
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if dist.get_rank() == 1:
        raise ValueError(f"attempt {attempt} fails")
    dist.barrier()
"""


def test_restarts_are_announced_and_the_last_failure_counts_the_attempts(tmp_path):
    script = write_script(tmp_path, "always_fails.py", ALWAYS_FAILS)
    result = run_cli("launch", "--nproc", "2", "--max-restarts", "1", str(script), timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    host = socket.gethostname()
    announced = [line for line in result.stderr.splitlines() if "restarting" in line]
    assert len(announced) == 1, result.stderr[-3000:]
    assert f"rank 1 on {host} failed: exit code 1 (ValueError: attempt 0 fails)" in announced[0]
    assert "restarting all 2 workers of this node (restart 1 of 1)" in announced[0]
    summary = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert summary[0].startswith(f"error: rank 1 on {host} failed first: exit code 1"), summary
    assert "ValueError: attempt 1 fails" in "\n".join(summary)
    assert "error:   every attempt failed: 2 of 2 (--max-restarts 1)" in summary, summary
    assert_none_left(str(script))


# --- modules and folders from the working folder (34.27) ------------------------------------


def ddpcli_program() -> str:
    """The `ddpcli` console script: its sys.path starts with its own folder, not the
    working one (`python -m ddpcli` would hide the problem)."""
    return str(Path(sys.executable).parent / "ddpcli")


def test_a_module_and_a_folder_run_from_the_working_folder(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write_script(package, "job.py", ALL_REDUCE)
    app = tmp_path / "app"
    app.mkdir()
    write_script(app, "__main__.py", ALL_REDUCE)
    env = clean_env(PYTHONPATH=str(REPO))
    for target in (["-m", "mypkg.job"], ["app"]):
        command = [ddpcli_program(), "launch", "--nproc", "2", *target, "--epochs", "1"]
        result = run_bounded(command, 180, env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert reported_ranks(result.stdout) == ["rank 0/2", "rank 1/2"], result.stdout
        assert "args ['--epochs', '1']" in result.stdout


def test_a_folder_without_main_is_refused(tmp_path, in_process):
    (tmp_path / "app").mkdir()
    result = in_process("launch", "--nproc", "2", "app", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "invalid SCRIPT: app is a folder without __main__.py" in result.stderr


# --- nothing of a worker left behind (34.29) ------------------------------------------------

# Rank 1 fails once rank 0's child is up: told by a file beside the script, not by a Gloo
# barrier (the ranks need no torch of their own to get there).
CHILD_IGNORES_SIGNALS = """
    import os, signal, subprocess, sys, time
    from pathlib import Path
    child_up = Path(__file__).with_name("child_up")
    if os.environ["RANK"] == "0":
        code = (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); print('child up', flush=True); "
            "time.sleep(600)"
        )
        child = subprocess.Popen([sys.executable, "-c", code, __file__], stdout=subprocess.PIPE)
        child.stdout.readline()
        child_up.touch()
    else:
        while not child_up.exists():
            time.sleep(0.05)
        raise ValueError("rank 1 fails")
    time.sleep(600)
"""


def test_a_workers_child_that_ignores_signals_is_ended(tmp_path):
    script = write_script(tmp_path, "stubborn_child.py", CHILD_IGNORES_SIGNALS)
    result = run_cli("launch", "--nproc", "2", str(script), timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"rank 1 on {socket.gethostname()} failed first" in result.stderr
    assert_none_left(str(script))


# --- GPUs a scheduler granted (40.2) --------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "expected"), [(None, list(range(8))), ("2,5", [2, 5]), ("-1", None)]
)
def test_without_nproc_launch_starts_one_process_per_granted_gpu(monkeypatch, visible, expected):
    from ddpcli.config.launch import build_launch_config
    from ddpcli.launcher import script_launch

    monkeypatch.setattr(script_launch, "physical_gpu_count", lambda: 8)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = script_launch.resolve_script_launch(build_launch_config({"target": "x.py"}, environ={}))
    if expected is None:  # no GPU granted: the CPU's default
        assert (cfg.gpus, cfg.nproc_per_node) == (None, script_launch.CPU_PROCESSES)
    else:
        assert cfg.nproc_per_node == len(expected)
        assert cfg.gpus == (expected if visible else None)


@pytest.mark.gpu
def test_launch_on_gpus_counts_the_granted_ones(tmp_path):
    script = write_script(
        tmp_path, "world.py", "import os\nprint('world', os.environ['WORLD_SIZE'], flush=True)\n"
    )
    result = run_cli("launch", str(script), env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("world 1") == 1, result.stdout
