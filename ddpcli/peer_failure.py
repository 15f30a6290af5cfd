"""The agent's SIGTERM after a rank failed, told apart from a scheduler's preemption.

`ddpcli train` takes SIGTERM as a preemption: checkpoint at the next agreed step, then stop
(ddpcli.stopping). The elastic agent sends the same signal to the surviving workers when
one of them dies, and a survivor stuck in a collective with the dead rank (NCCL need not
notice a dead peer on the same node; a rank busy loading data has not yet reached one)
then waited for the agent's SIGKILL, 30 s later, after printing its stack. So before the
agent stops the survivors it touches a notice file beside their config, and a worker that
finds the notice when the signal comes leaves at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Beside a launch's private worker config (the agent's side) and read there by its workers.
PEER_FAILED_FILE = "peer-failed"


class NoticeBeforeStopping:
    """Mixed into elastic's two process contexts (a worker forked or run as a program): the
    poll that finds a failed worker stops the others, so the notice is touched before it."""

    notice: Path

    def _start(self) -> None:
        self.notice.unlink(missing_ok=True)  # a restart: its workers start afresh
        super()._start()  # type: ignore[misc]

    def _poll(self) -> Any:
        if self._a_worker_failed():
            with contextlib.suppress(OSError):
                self.notice.touch()
        return super()._poll()  # type: ignore[misc]

    def _a_worker_failed(self) -> bool:
        processes = getattr(self, "_pc", None)
        if processes is not None:  # forked: multiprocessing's processes
            return any(p.exitcode not in (0, None) for p in processes.processes)
        handlers = getattr(self, "subprocess_handlers", {})
        return any(h.proc.poll() not in (0, None) for h in handlers.values())


@contextlib.contextmanager
def peer_failures_noticed(notice: Path | None) -> Iterator[None]:
    """While it lasts, the agent touches NOTICE before it stops the workers after one
    failed (None: nothing changes). Patches the contexts elastic starts workers in."""
    if notice is None:
        yield
        return
    from torch.distributed.elastic import multiprocessing as elastic_mp

    names = ("MultiprocessContext", "SubprocessContext")
    originals = {name: getattr(elastic_mp, name) for name in names}
    try:
        for name, base in originals.items():
            setattr(elastic_mp, name, type(name, (NoticeBeforeStopping, base), {"notice": notice}))
        yield
    finally:
        for name, base in originals.items():
            setattr(elastic_mp, name, base)
