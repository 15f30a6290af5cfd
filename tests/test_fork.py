"""Forked workers (ddpcli/fork.py): elastic's function path made to behave as its program
path does: each worker named, stopped by SIGTERM as a program would be, and every failed
rank reported, not only the first."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic import multiprocessing as elastic_mp
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from ddpcli.fork import every_failure_reported, forks_workers, start_forked_worker


def main(argv: list[str]) -> None:
    """A forked worker's entry (start_forked_worker imports this module): leave its process
    name in a file, then exit with a code after a delay."""
    _, record, code, delay_s = argv
    Path(record).write_text(Path("/proc/self/comm").read_text().strip())
    time.sleep(float(delay_s))
    os._exit(int(code))


def failed_ranks(folder: Path) -> dict[int, int]:
    """Rank 0 fails after 2 s with exit code 3; rank 1 is still running then, and is stopped."""
    folder.mkdir()
    context = elastic_mp.start_processes(
        name="fork-test",
        entrypoint=start_forked_worker,
        args={
            rank: (__name__, str(folder / f"comm-{rank}"), code, delay)
            for rank, code, delay in ((0, "3", "2"), (1, "0", "60"))
        },  # fmt: skip
        envs={rank: {"RANK": str(rank)} for rank in (0, 1)},
        logs_specs=DefaultLogsSpecs(log_dir=str(folder)),
        start_method="fork",
    )
    result = context.wait(timeout=60, period=0.1)
    assert result is not None and result.is_failed()
    names = [(folder / f"comm-{rank}").read_text() for rank in (0, 1)]
    assert names == ["ddpcli rank 0", "ddpcli rank 1"]  # what ps -e shows
    return {rank: failure.exitcode for rank, failure in result.failures.items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux only")
def test_every_failed_rank_is_reported_not_only_the_first(tmp_path):
    assert failed_ranks(tmp_path / "plain") == {0: 3}  # elastic's own function path
    original = elastic_mp.MultiprocessContext
    with every_failure_reported():
        assert failed_ranks(tmp_path / "patched") == {0: 3, 1: -signal.SIGTERM}
    assert elastic_mp.MultiprocessContext is original


def test_only_cpu_jobs_on_linux_fork():
    assert forks_workers(uses_gpus=False) == sys.platform.startswith("linux")
    assert not forks_workers(uses_gpus=True)
