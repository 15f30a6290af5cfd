"""What the agent tells its workers: that another worker failed, before it stops them, and
that they start a later round of the job.

- It kills what the failed worker left behind: the rest of its process group (each worker
  leads one). Its DataLoader workers, forked after its process group formed, hold copies of
  its sockets: left alive, they kept the other ranks from seeing it go until their own
  check of their parent (every 5 s), and outlived the job by as much.
- It leaves a notice for workers that take SIGTERM as a preemption (`ddpcli train`:
  checkpoint at the next agreed step, then stop; ddpcli.training.stopping). The agent stops the
  surviving workers with that same signal, and a survivor stuck in a collective with the
  dead rank (NCCL need not notice a dead peer on the same node; a rank busy loading data
  has not yet reached one) waited for the agent's SIGKILL, 30 s later, after printing its
  stack. The notice is a file beside their config; a worker that finds it when the signal
  comes leaves at once.
- When it has stopped its workers, it ends what they left in their sessions: a child that
  ignores SIGTERM and SIGINT outlived its worker, and the job (torchrun's too).
- On Ctrl-C, a worker that has not ended a few seconds later is named, with the way out: it
  is stuck where Python never looks at the signal (a collective or init_process_group whose
  peer is gone, native code), and would hold the terminal silently for the rest of the
  agent's 30 s grace. A second Ctrl-C ends every worker's session at once.
- It marks every start after its first as a later round (LATER_ROUND_FILE): a restart after
  a failure counts in TORCHELASTIC_RESTART_COUNT, but a restart because hosts joined or left
  an elastic job counts nowhere, and its workers must continue the run, not start it over.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddpcli import ui
from ddpcli.collectives.gather import await_records, clear_records, request_records
from ddpcli.records import LATER_ROUND_FILE


class FailedWorkerHandling:
    """Mixed into elastic's two process contexts (workers forked or run as programs): the
    poll that finds a failed worker stops the others, so this comes just before it."""

    notice: Path | None = None
    records: Path | None = None  # where the workers leave their flight records
    starts = 0  # on the class made for one launch: how often it has started its workers
    records_asked = False

    def _start(self) -> None:
        if self.notice is not None:
            self.notice.unlink(missing_ok=True)  # a restart: its workers start afresh
            if type(self).starts > 0:
                self.notice.with_name(LATER_ROUND_FILE).touch()
        type(self).starts += 1
        if self.records is not None:  # a restart: its records are of a round now over
            clear_records(self.records)
            self.records_asked = False
        super()._start()  # type: ignore[misc]

    def _poll(self) -> Any:
        failed = self._failed_worker_pids()
        if failed and self.notice is not None:
            with contextlib.suppress(OSError):
                self.notice.touch()
        for pid in failed:
            with contextlib.suppress(OSError):  # its group may be empty already
                os.killpg(pid, signal.SIGKILL)
        if failed and self.records is not None and not self.records_asked:
            self.ask_for_records(self.records, failed)
        return super()._poll()  # type: ignore[misc]

    def ask_for_records(self, records: Path, failed: list[int]) -> None:
        """Before the others are stopped: each live rank's flight record (not the FAILED
        workers'), for the verdict on where the ranks parted. A bounded wait: a rank stuck
        where it cannot dump leaves none."""
        self.records_asked = True
        request_records(records)
        await_records(records, self._ranks_of_workers_but(set(failed)))

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        workers = self._worker_pids()
        notice = self.stuck_named_later(timeout) if death_sig == signal.SIGINT else None
        try:
            super()._close(death_sig, timeout)  # type: ignore[misc]
        except BaseException:  # a second Ctrl-C, raised here by the agent's handler: now
            end_what_workers_left(workers, grace_s=0)
            raise
        finally:
            if notice is not None:
                notice.cancel()
        end_what_workers_left(workers)

    def stuck_named_later(self, grace_s: int) -> threading.Timer:
        def name_them() -> None:
            ranks = self._ranks_of_workers_but(set(self._ended_worker_pids()))
            if ranks:
                ui.warn(
                    f"rank(s) {', '.join(map(str, ranks))} still running "
                    f"{STUCK_NOTICE_AFTER_S:g} s after Ctrl-C (inside a collective or native "
                    f"code, where Python does not see it): killed at {grace_s} s; Ctrl-C again "
                    "ends them now"
                )

        timer = threading.Timer(STUCK_NOTICE_AFTER_S, name_them)
        timer.daemon = True
        timer.start()
        return timer

    def _ranks_of_workers_but(self, pids: set[int]) -> list[int]:
        """The global ranks of this node's workers, but those of PIDS."""
        envs: dict[int, dict[str, str]] = getattr(self, "envs", {})
        return [
            int(envs[local_rank]["RANK"])
            for local_rank, pid in enumerate(self._worker_pids())
            if pid not in pids and "RANK" in envs.get(local_rank, {})
        ]

    def _worker_pids(self) -> list[int]:
        return list(self._exit_codes())

    def _failed_worker_pids(self) -> list[int]:
        return [pid for pid, code in self._exit_codes().items() if code not in (0, None)]

    def _ended_worker_pids(self) -> list[int]:
        return [pid for pid, code in self._exit_codes().items() if code is not None]

    def _exit_codes(self) -> dict[int, int | None]:
        """Each worker's exit code by its pid; None while it runs."""
        processes = getattr(self, "_pc", None)
        if processes is not None:  # forked: multiprocessing's processes
            return {p.pid: p.exitcode for p in processes.processes if p.pid is not None}
        handlers = getattr(self, "subprocess_handlers", {}).values()
        return {h.proc.pid: h.proc.poll() for h in handlers}


# How long after Ctrl-C a worker still running is named (a clean stop takes well under it).
STUCK_NOTICE_AFTER_S = 3.0

# A worker's children had the worker's own grace to end on its signal (the agent signals
# each worker's process group): a little more, then they are killed.
LEFTOVER_GRACE_S = 2.0


def end_what_workers_left(workers: list[int], grace_s: float = LEFTOVER_GRACE_S) -> None:
    """Once the agent has stopped its workers: every process still in a worker's session
    (each worker leads one), such as a child that ignores SIGTERM and SIGINT, gets SIGTERM
    (forked workers' children got nothing yet), GRACE_S to end, then SIGKILL."""
    left = session_members(set(workers))
    for pid in left:
        signal_quietly(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = session_members(set(workers))
    for pid in left:
        signal_quietly(pid, signal.SIGKILL)


def signal_quietly(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(OSError):  # gone already
        os.kill(pid, signum)


def session_members(sessions: set[int]) -> list[int]:
    """Live processes (not zombies) in one of SESSIONS or of their process groups. Linux
    reads them from /proc; elsewhere none are found (each group was signalled already)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*") if sessions else []:
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses.
        state, _ppid, group, session = stat.rpartition(")")[2].split()[:4]
        pid = int(entry.name)
        if state != "Z" and pid != os.getpid() and sessions & {int(group), int(session)}:
            members.append(pid)
    return members


@contextlib.contextmanager
def failed_workers_handled(notice: Path | None, records: Path | None = None) -> Iterator[None]:
    """While it lasts, the agent kills a failed worker's process group, touches NOTICE
    (unless None) and asks the others for their flight records in RECORDS (unless None)
    before it stops them. Patches the contexts elastic starts workers in."""
    from torch.distributed.elastic import multiprocessing as elastic_mp

    names = ("MultiprocessContext", "SubprocessContext")
    originals = {name: getattr(elastic_mp, name) for name in names}
    try:
        for name, base in originals.items():
            own = {"notice": notice, "records": records}
            mixed = type(name, (FailedWorkerHandling, base), own)
            setattr(elastic_mp, name, mixed)
        yield
    finally:
        for name, base in originals.items():
            setattr(elastic_mp, name, base)
