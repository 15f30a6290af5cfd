"""One function over many shards, in worker processes: results in the tasks' order, each
reported as it finishes; on an error or Ctrl-C, every worker ended before it is raised."""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from typing import TypeVar

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


class InterruptsHeld:
    """Ctrl-C taken when the block ends, not inside it: a KeyboardInterrupt in the middle of
    starting or stopping the pool (a worker half launched, the executor's own bookkeeping
    cut short) leaves workers that no one ends, and an exit that waits for them forever."""

    def __enter__(self) -> InterruptsHeld:
        self.came = False
        self.previous = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.note)
        return self

    def note(self, signum: int, frame: object) -> None:
        self.came = True

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGINT, self.previous)
        if self.came and kind is None and callable(self.previous):
            self.previous(signal.SIGINT, None)  # Python's own: raises KeyboardInterrupt


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
    left; what a stopped worker leaves is its caller's to clear (pack: temporary files)."""
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
