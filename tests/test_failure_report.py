"""The report of a failed job, from the error files its ranks left: who is named, and the
places of the ranks the agent stopped (the words `ddpcli train`'s workers record as they
leave on its SIGTERM)."""

from __future__ import annotations

import signal
import socket

import pytest

from ddpcli.errors import STOPPED_FOR_PEER

HOST = socket.gethostname()
# What each rank's RuntimeError said.
TIMED_OUT = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms"
LOST = "[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:4803"
WAITING = (
    f"{STOPPED_FOR_PEER} while waiting at ddpcli/training/loop.py:120 in step(): loss.backward()"
)
BUSY = f"{STOPPED_FOR_PEER} while busy at ddpcli/data/loader.py:88 in __iter__(): next(it)"


@pytest.fixture
def failure(tmp_path, monkeypatch):
    """failure({rank: exit code or (exit code, recorded error words)}) -> ChildFailedError."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpcli.process import record_for_agent

    def build(ranks: dict[int, int | tuple[int, str]]) -> ChildFailedError:
        failures = {}
        for rank, ended in ranks.items():
            code, words = ended if isinstance(ended, tuple) else (ended, "")
            error_file = tmp_path / f"error-{rank}.json"
            if words:
                monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
                record_for_agent(RuntimeError(words))
            failures[rank] = ProcessFailure(rank, 1000 + rank, code, str(error_file))
        return ChildFailedError("worker", failures)

    return build


def report(failed) -> list[str]:
    from ddpcli.launcher.failure_report import describe_failure

    return describe_failure(failed, timeout_s=5).message.splitlines()


def test_a_rank_busy_when_stopped_is_the_one_the_others_waited_for(failure):
    lines = report(failure({0: (1, TIMED_OUT), 1: (1, WAITING), 2: (1, BUSY), 3: (1, TIMED_OUT)}))
    assert lines == [
        f"rank 2 on {HOST} stopped responding: ranks 0, 1, 3 waited for it for --timeout (5 s) "
        "at a collective and gave up; it was then stopped (SIGTERM) while still at "
        "ddpcli/data/loader.py:88 in __iter__(): next(it)"
    ]


def test_a_rank_waiting_when_stopped_is_not_blamed(failure):
    lines = report(failure({0: (1, TIMED_OUT), 1: (1, WAITING)}))
    assert lines[0] == f"rank 0 on {HOST} stopped first: exit code 1 (then rank 1 stopped)"
    assert "a collective did not finish within --timeout" in lines[1]


def test_a_node_that_only_suffered_says_where_its_stopped_ranks_were(failure):
    busy_elsewhere = BUSY.replace("loader.py:88", "loader.py:99")
    ranks = {4: (1, LOST), 5: (1, WAITING), 6: (1, busy_elsewhere), 7: (1, WAITING)}
    lines = report(failure(ranks))
    assert lines[0] == f"rank 4 on {HOST} stopped first: exit code 1 (then ranks 5, 6, 7 stopped)"
    assert lines[-2:] == [
        "  when stopped, ranks 5, 7 were at ddpcli/training/loop.py:120 in step(): loss.backward()",
        "  when stopped, rank 6 was at ddpcli/data/loader.py:99 in __iter__(): next(it)",
    ]


def test_a_rank_that_failed_of_itself_is_named_without_the_places(failure):
    lines = report(failure({0: (1, WAITING), 1: -signal.SIGKILL}))
    assert lines == [
        f"rank 1 on {HOST} failed first: killed by SIGKILL (most likely out of memory, or the "
        "scheduler) (then rank 0 stopped)"
    ]


def test_on_one_node_a_rank_that_ended_early_is_named_not_another_node(failure):
    """Rank 1 called sys.exit(0): the agent reports only rank 0, which lost it (34.22)."""
    from ddpcli.launcher.failure_report import describe_failure

    lines = describe_failure(failure({0: (1, LOST)}), world_size=2).message.splitlines()
    assert lines[0].startswith(f"rank 1 on {HOST} ended early: its script finished (returned")
    assert lines[1] == "  rank 0 lost its connection to it"
    assert "another node" not in "\n".join(lines)


def test_on_one_node_a_lost_peer_is_not_sent_to_another_node(failure):
    from ddpcli.launcher.failure_report import describe_failure

    lines = describe_failure(failure({0: (1, LOST), 1: -signal.SIGTERM}), world_size=2).message
    assert "which most likely died first" in lines and "another node" not in lines


def test_a_failed_round_in_a_line_and_the_attempts_counted(failure):
    """--max-restarts (34.26): the round's rank and its error, then every attempt counted."""
    from ddpcli.launcher.failure_report import describe_failure, round_in_words

    failed = failure({0: (1, "ValueError: bad batch"), 1: -signal.SIGTERM})
    assert round_in_words(failed.failures) == (
        f"rank 0 on {HOST} failed: exit code 1 (RuntimeError: ValueError: bad batch)"
    )
    assert round_in_words(failure({1: -signal.SIGKILL}).failures) == (
        f"rank 1 on {HOST} failed: killed by SIGKILL (most likely out of memory, or the scheduler)"
    )
    lines = describe_failure(failed, attempts=3).message.splitlines()
    assert lines[-1] == "  every attempt failed: 3 of 3 (--max-restarts 2)"
