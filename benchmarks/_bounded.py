"""Running a contender as its own process tree, bounded in time, for the benchmarks.

A contender is a launcher (ddpcli, torchrun, Lightning) whose workers may sit in sessions
of their own: on timeout, and after every run, the whole tree is ended, so no straggler
slows the next contender.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

KILL_GRACE_S = 5


def run_bounded(
    command: list[str], env: dict, cwd: Path, log: Path, timeout_s: float
) -> tuple[int, float]:
    """Run `command` in its own session; on timeout end its whole process tree.
    Returns the exit code and the wall time."""
    start = time.perf_counter()
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = 124
        finally:
            end_session(process)  # stragglers (a rank left behind) go with the session
    return code, time.perf_counter() - start


def end_session(process: subprocess.Popen) -> None:
    """SIGTERM the run's process group and every descendant (elastic agents start their
    workers in sessions of their own), SIGKILL what is left after a grace period."""
    tree = descendants(process.pid)
    signal_all(process.pid, tree, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        process.poll()  # reap the leader, or the group never empties
        tree = [pid for pid in tree if alive(pid)]
        if not tree and not group_alive(process.pid):
            return
        time.sleep(0.1)
    signal_all(process.pid, tree, signal.SIGKILL)
    process.wait()


def descendants(root: int) -> list[int]:
    """Every process below `root`, read from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(group: int, pids: list[int], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
