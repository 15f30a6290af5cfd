"""One function over many shards, in worker processes: results in the tasks' order, each
reported as it finishes; on an error or Ctrl-C, every worker ended before it is raised."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from typing import TypeVar

from ddpcli.interrupts import InterruptsHeld

Task = TypeVar("Task")
Result = TypeVar("Result")

# How long a killed worker may take to be reaped.
STOP_TIMEOUT_S = 10.0


def ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_fork_server() -> None:
    """The server that forks the workers (a fork of this process would copy the progress
    bar's thread mid-lock), started with SIGINT ignored: it passes that on to every worker
    it forks, which cannot then be interrupted even before ignore_interrupts runs."""
    from multiprocessing import forkserver

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()  # starts it, and waits for nothing
    finally:
        signal.signal(signal.SIGINT, previous)


def run_parallel(
    function: Callable[[Task], Result],
    tasks: Sequence[Task],
    processes: int,
    on_result: Callable[[Result], None] = lambda result: None,
) -> list[Result]:
    """FUNCTION over TASKS in up to PROCESSES processes (one: in this process). The first
    error stops the rest and is raised here.

    Ctrl-C is this process's alone: the workers ignore it (a traceback each otherwise). It
    stops them at once (`stop_workers`), so that the command ends with no process of it
    left; what a stopped worker leaves is its caller's to clear (pack: temporary files).
    It is held while the pool starts, takes tasks or stops: one in the middle of that (a
    worker half launched, the executor's own bookkeeping cut short) left workers that no
    one ended, and an exit that waited for them forever."""
    if processes <= 1 or len(tasks) <= 1:
        results = []
        for task in tasks:
            results.append(function(task))
            on_result(results[-1])
        return results
    pool = start_pool(min(processes, len(tasks)))
    try:
        with InterruptsHeld():
            futures = [pool.submit(function, task) for task in tasks]
        results = collect(futures, on_result)
    except BaseException:
        with InterruptsHeld():
            stop_workers(pool)
        raise
    with InterruptsHeld():
        pool.shutdown(wait=True)
    return results


def start_pool(processes: int) -> ProcessPoolExecutor:
    """The pool, its fork server running; its workers start as tasks are submitted."""
    with InterruptsHeld():
        start_fork_server()
        return ProcessPoolExecutor(
            processes,
            mp_context=multiprocessing.get_context("forkserver"),
            initializer=ignore_interrupts,
        )


def stop_workers(pool: ProcessPoolExecutor) -> None:
    """Every worker ended now (SIGKILL: no worker may outlive the command, whatever it was
    doing), and the pool's own thread with them: it finds them gone and fails every task
    not done (a task cancelled here first would make that thread fail on it)."""
    workers = list((pool._processes or {}).values())  # the executor names them nowhere else
    for worker in workers:
        worker.kill()
    for worker in workers:
        worker.join(timeout=STOP_TIMEOUT_S)
    pool.shutdown(wait=True)


def collect(futures: list[Future[Result]], on_result: Callable[[Result], None]) -> list[Result]:
    pending = set(futures)
    while pending:
        done, pending = wait(pending, return_when=FIRST_EXCEPTION)
        for future in done:
            on_result(future.result())
    return [future.result() for future in futures]
