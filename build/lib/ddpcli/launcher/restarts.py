"""--max-restarts in words: each restart said as it comes, with the rank whose failure
caused it, and the count of attempts in the final report. Elastic's agent restarts its
workers silently (its own log line is at INFO, and quieted with the rest of its logs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ddpcli import ui
from ddpcli.launcher.failure_report import round_in_words


@dataclass
class Attempts:
    """The rounds of workers this node has started after a failure, plus the first."""

    made: int = 1


@contextlib.contextmanager
def restarts_announced(max_restarts: int, nproc_per_node: int) -> Iterator[Attempts]:
    """While it lasts, the agent that torch's launcher makes says each restart in a line
    before it makes it; the Attempts it yields count them."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
    from torch.distributed.launcher import api

    attempts = Attempts()

    class AnnouncingAgent(api.LocalElasticAgent):
        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result: RunResult = super()._monitor_workers(worker_group)
            failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            if failed and self._remaining_restarts > 0:  # the agent restarts them next
                restart = max_restarts - self._remaining_restarts + 1
                ui.warn(
                    f"{round_in_words(result.failures)}; restarting all {nproc_per_node} "
                    f"workers of this node (restart {restart} of {max_restarts})"
                )
                attempts.made += 1
            return result

    original: Any = api.LocalElasticAgent
    setattr(api, "LocalElasticAgent", AnnouncingAgent)  # noqa: B010
    try:
        yield attempts
    finally:
        setattr(api, "LocalElasticAgent", original)  # noqa: B010
