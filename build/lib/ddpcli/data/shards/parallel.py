"""One function over many shards, in worker processes: results in the tasks' order, each
reported as it finishes."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from typing import TypeVar

Task = TypeVar("Task")
Result = TypeVar("Result")


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

    Ctrl-C is this process's alone: the workers ignore it (a traceback each otherwise),
    finish the task in hand and take no other."""
    if processes <= 1 or len(tasks) <= 1:
        results = []
        for task in tasks:
            results.append(function(task))
            on_result(results[-1])
        return results
    start_fork_server()
    pool = ProcessPoolExecutor(
        min(processes, len(tasks)),
        mp_context=multiprocessing.get_context("forkserver"),
        initializer=ignore_interrupts,
    )
    futures = [pool.submit(function, task) for task in tasks]
    try:
        return collect(futures, on_result)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def collect(futures: list[Future[Result]], on_result: Callable[[Result], None]) -> list[Result]:
    pending = set(futures)
    while pending:
        done, pending = wait(pending, return_when=FIRST_EXCEPTION)
        for future in done:
            on_result(future.result())
    return [future.result() for future in futures]
