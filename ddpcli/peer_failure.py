"""What the agent tells its workers: that another worker failed, before it stops them, and
that they start a later round of the job.

- It kills what the failed worker left behind: the rest of its process group (each worker
  leads one). Its DataLoader workers, forked after its process group formed, hold copies of
  its sockets: left alive, they kept the other ranks from seeing it go until their own
  check of their parent (every 5 s), and outlived the job by as much.
- It leaves a notice for workers that take SIGTERM as a preemption (`ddpcli train`:
  checkpoint at the next agreed step, then stop; ddpcli.stopping). The agent stops the
  surviving workers with that same signal, and a survivor stuck in a collective with the
  dead rank (NCCL need not notice a dead peer on the same node; a rank busy loading data
  has not yet reached one) waited for the agent's SIGKILL, 30 s later, after printing its
  stack. The notice is a file beside their config; a worker that finds it when the signal
  comes leaves at once.
- It marks every start after its first as a later round (LATER_ROUND_FILE): a restart after
  a failure counts in TORCHELASTIC_RESTART_COUNT, but a restart because hosts joined or left
  an elastic job counts nowhere, and its workers must continue the run, not start it over.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Beside a launch's private worker config (the agent's side) and read there by its workers.
PEER_FAILED_FILE = "peer-failed"
LATER_ROUND_FILE = "later-round"


class FailedWorkerHandling:
    """Mixed into elastic's two process contexts (workers forked or run as programs): the
    poll that finds a failed worker stops the others, so this comes just before it."""

    notice: Path | None = None
    starts = 0  # on the class made for one launch: how often it has started its workers

    def _start(self) -> None:
        if self.notice is not None:
            self.notice.unlink(missing_ok=True)  # a restart: its workers start afresh
            if type(self).starts > 0:
                self.notice.with_name(LATER_ROUND_FILE).touch()
        type(self).starts += 1
        super()._start()  # type: ignore[misc]

    def _poll(self) -> Any:
        failed = self._failed_worker_pids()
        if failed and self.notice is not None:
            with contextlib.suppress(OSError):
                self.notice.touch()
        for pid in failed:
            with contextlib.suppress(OSError):  # its group may be empty already
                os.killpg(pid, signal.SIGKILL)
        return super()._poll()  # type: ignore[misc]

    def _failed_worker_pids(self) -> list[int]:
        processes = getattr(self, "_pc", None)
        if processes is not None:  # forked: multiprocessing's processes
            return [p.pid for p in processes.processes if p.exitcode not in (0, None)]
        handlers = getattr(self, "subprocess_handlers", {}).values()
        return [h.proc.pid for h in handlers if h.proc.poll() not in (0, None)]


@contextlib.contextmanager
def failed_workers_handled(notice: Path | None) -> Iterator[None]:
    """While it lasts, the agent kills a failed worker's process group and touches NOTICE
    (unless None) before it stops the other workers. Patches the contexts elastic starts
    workers in."""
    from torch.distributed.elastic import multiprocessing as elastic_mp

    names = ("MultiprocessContext", "SubprocessContext")
    originals = {name: getattr(elastic_mp, name) for name in names}
    try:
        for name, base in originals.items():
            mixed = type(name, (FailedWorkerHandling, base), {"notice": notice})
            setattr(elastic_mp, name, mixed)
        yield
    finally:
        for name, base in originals.items():
            setattr(elastic_mp, name, base)
