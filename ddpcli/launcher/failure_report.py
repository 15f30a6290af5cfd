"""How a failed job is reported: the rank that failed first (not one that only lost its
peer, or that the agent stopped), how it ended in words, the last lines it left, and where
the stopped ranks were.

The agent's ChildFailedError orders failures by a timestamp in whole seconds; the rules
here find the cause among them.
"""

from __future__ import annotations

import re
import signal
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ddpcli.errors import (
    STOPPED_FOR_PEER,
    TIMED_OUT,
    USAGE,
    DdpcliError,
    lost_a_peer,
    runtime_error,
    usage_error,
)
from ddpcli.stacks import (
    finished_file_name,
    innermost_users_frame,
    place_in_words,
    stack_file_name,
    where_stopped,
)

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure


def describe_failure(
    failure: ChildFailedError,
    log_dir: str | None = None,
    timeout_s: float | None = None,
    stacks: Path | None = None,
    world_size: int | None = None,
    attempts: int = 1,
) -> DdpcliError:
    """Name the first rank that failed, how it ended, and the last lines it printed. STACKS:
    the folder where the workers wrote their stacks when stopped (None: to their stderr).
    WORLD_SIZE: every rank of a job on this one node (None: on several, some unseen here).
    ATTEMPTS: the rounds of workers that failed (after --max-restarts restarts)."""
    failures = failure.failures
    rank, first = unresponsive_rank(failures) or first_cause(failures)
    early = ended_early(failures, world_size, stacks)
    if early and knock_on_effect(first):
        lines = ended_early_in_words(early, failures)
    else:
        lines = first_failure_in_words(rank, first, failures, timeout_s, stacks, world_size)
    if log_dir:
        lines.append(f"  its output: {rank_log(log_dir, first.local_rank)}")
    # The cause is elsewhere (no rank here failed of itself): a stuck rank here stands out.
    if knock_on_effect(first) and not (early or stopped_responding(first, failures)):
        lines.extend(places_of_stopped_ranks(failures, stacks))
    if attempts > 1:
        restarts = f"--max-restarts {attempts - 1}"
        lines.append(f"  every attempt failed: {attempts} of {attempts} ({restarts})")
    code = USAGE if first.exitcode == USAGE else 1
    return usage_error("\n".join(lines)) if code == USAGE else runtime_error("\n".join(lines))


def first_failure_in_words(
    rank: int,
    first: ProcessFailure,
    failures: Mapping[int, ProcessFailure],
    timeout_s: float | None,
    stacks: Path | None,
    world_size: int | None,
) -> list[str]:
    others = sorted(r for r in failures if r != rank)
    host = socket.gethostname()
    consequence = ""
    if stopped_responding(first, failures):
        where = stopped_place(rank, first, stacks)
        in_words = unresponsive_in_words(others, first.exitcode, timeout_s, stacks, where)
        lines = [f"rank {rank} on {host} {in_words}"]
    else:
        consequence = knock_on_effect(first, one_node=world_size is not None)
        verb = "stopped" if consequence else "failed"
        lines = [f"rank {rank} on {host} {verb} first: {exit_in_words(first.exitcode)}"]
        if others:
            lines[0] += f" (then {rank_list(others)} stopped)"
        if consequence:
            lines.append(f"  {consequence}")
    if busy_when_stopped(first):  # said above
        return lines
    place = users_place(first) if consequence else None
    detail = f"  at {place}" if place else error_tail(first)
    return [*lines, detail] if detail else lines


def ended_early(
    failures: Mapping[int, ProcessFailure], world_size: int | None, stacks: Path | None
) -> list[int]:
    """The ranks whose script ended well: those that said so in STACKS (the agent may
    have stopped them in their exit), and on one node of WORLD_SIZE ranks, those not among
    its failures."""
    said = {rank for rank in failures if stacks and (stacks / finished_file_name(rank)).exists()}
    missing = {rank for rank in range(world_size or 0) if rank not in failures}
    return sorted(said | missing)


def ended_early_in_words(early: list[int], failures: Mapping[int, ProcessFailure]) -> list[str]:
    """Every failure only says a peer went: the peer is a rank whose script ended well
    (sys.exit(0), or a return) while the others still called collectives with it."""
    them = "it" if len(early) == 1 else "them"
    lines = [
        f"{rank_list(early)} on {socket.gethostname()} ended early: its script finished "
        f"(returned or called sys.exit(0)) while the other ranks still needed {them} at a "
        "collective; every rank must make the same collective calls before it ends"
    ]
    for rank, process in sorted(failures.items()):
        if rank in early:
            continue
        place = users_place(process)
        at = f" at {place}" if place else ""
        if lost_a_peer(last_error_line(process)):
            lines.append(f"  rank {rank} lost its connection to {them}{at}")
        elif timed_out(process):
            lines.append(f"  rank {rank} gave up waiting for {them}{at}")
        else:
            lines.append(f"  rank {rank} then stopped: {exit_in_words(process.exitcode)}")
    return lines


def users_place(process: ProcessFailure) -> str | None:
    """The script's innermost line in the traceback a rank recorded, in words."""
    frame = innermost_users_frame(failure_text(process))
    return place_in_words(frame) if frame else None


def round_in_words(failures: Mapping[int, ProcessFailure]) -> str:
    """One failed round of workers in a line, before they are restarted: the rank that
    failed first, how, and its exception's last line."""
    if not failures:
        return "the workers failed"
    rank, first = unresponsive_rank(failures) or first_cause(failures)
    words = f"rank {rank} on {socket.gethostname()} failed: {exit_in_words(first.exitcode)}"
    error = last_error_line(first)
    if error and not error.startswith(("Signal ", "To enable traceback", "<NONE>")):
        words += f" ({error})"
    return words


def rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def stopped_responding(first: ProcessFailure, failures: Mapping[int, ProcessFailure]) -> bool:
    """Killed (SIGTERM, or SIGKILL when it could not act on that), or gone on the SIGTERM
    while busy outside any collective, no earlier than the others gave up waiting for it at
    a collective: most likely the agent stopping a rank that was hung or stopped, rather
    than the kernel out of memory. The two cannot be told apart for sure, so the words say
    what was seen."""
    stopped = first.exitcode in (-signal.SIGKILL, -signal.SIGTERM) and not timed_out(first)
    if not (stopped or busy_when_stopped(first)):
        return False
    others = [other for other in failures.values() if other is not first]
    waited = [other for other in others if timed_out(other)]
    return bool(waited) and first.timestamp >= min(other.timestamp for other in waited)


def unresponsive_rank(
    failures: Mapping[int, ProcessFailure],
) -> tuple[int, ProcessFailure] | None:
    """The lowest rank the others gave up waiting for, if any: the cause, though the ranks
    that timed out ended first."""
    for rank, process in sorted(failures.items()):
        if stopped_responding(process, failures):
            return rank, process
    return None


def unresponsive_in_words(
    others: list[int],
    exitcode: int,
    timeout_s: float | None,
    stacks: Path | None = None,
    where: str | None = None,
) -> str:
    waited = f" for --timeout ({timeout_s:g} s)" if timeout_s else ""
    if exitcode != -signal.SIGKILL and where:  # SIGTERM, or a worker that left on it
        end = f"it was then stopped (SIGTERM) while still at {where}"
    elif exitcode == -signal.SIGTERM and stacks is None:
        end = (
            "it was then stopped (SIGTERM); the stack it printed then shows where it was "
            "(hung in a call, or never reaching the collective)"
        )
    elif exitcode != -signal.SIGKILL:
        end = "it was then stopped (SIGTERM): hung in a call, or never reaching the collective"
    else:
        end = (
            "it was then killed (SIGKILL) because it did not stop when asked, so it was most "
            "likely hung or stopped (SIGSTOP, a debugger, a stuck I/O or device call)"
        )
    gave_up = f"{rank_list(others)} waited for it{waited} at a collective and gave up"
    return f"stopped responding: {gave_up}; {end}"


def first_cause(failures: Mapping[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The rank whose failure started it all. The agent orders failures by a timestamp in
    whole seconds, so a rank that only lost its peer, or that the agent stopped (SIGTERM),
    can tie with the rank that really died and be named first."""

    def order(item: tuple[int, ProcessFailure]) -> tuple[bool, int]:
        return bool(knock_on_effect(item[1])), item[1].timestamp

    return sorted(failures.items(), key=order)[0]


def last_error_line(failure: ProcessFailure) -> str:
    """The exception itself, not the code in the traceback."""
    lines = failure_text(failure).strip().splitlines()
    return lines[-1] if lines else ""


def timed_out(failure: ProcessFailure) -> bool:
    """The rank gave up at a collective after --timeout."""
    return any(marker in last_error_line(failure) for marker in TIMED_OUT)


def failed_of_itself(failures: Mapping[int, ProcessFailure]) -> bool:
    """The first rank to fail raised an error of its own (bad input, an exception in its
    code), which the report quotes: not a rank killed, stuck, or at odds with the others."""
    if unresponsive_rank(failures) is not None:
        return False
    _, first = first_cause(failures)
    error = last_error_line(first)
    return first.exitcode > 0 and error not in ("", "<NONE>") and not knock_on_effect(first)


def knock_on_effect(failure: ProcessFailure, one_node: bool = False) -> str:
    """Why this failure is probably not the cause, or "" if it may be. ONE_NODE: every
    rank of the job ran here, so the cause is no other node's."""
    text = last_error_line(failure)
    if failure.exitcode == -signal.SIGTERM or STOPPED_FOR_PEER in text:
        return "it was stopped because another rank failed"
    if lost_a_peer(text):
        elsewhere = "" if one_node else " (on another node: see that node's output)"
        return f"it lost its connection to another rank, which most likely died first{elsewhere}"
    if timed_out(failure):
        return (
            "a collective did not finish within --timeout: another rank stopped responding "
            "(a node down or hung, or the network between them)"
        )
    return ""


def newest_run_log_dir(log_dir: str) -> Path:
    """The agent writes LOG_DIR/<run id>_<random>/attempt_N/<local rank>/{stdout,stderr}.log."""
    root = Path(log_dir)
    runs = [path for path in root.iterdir() if path.is_dir()] if root.is_dir() else []
    return max(runs, key=lambda path: path.stat().st_mtime) if runs else Path(log_dir)


def rank_log(log_dir: str, local_rank: int) -> Path:
    attempts = newest_run_log_dir(log_dir).glob("attempt_*")
    base = max(attempts, key=lambda path: path.stat().st_mtime, default=Path(log_dir))
    return base / str(local_rank) / "stderr.log"


def exit_in_words(exitcode: int, guess: bool = True) -> str:
    """GUESS: say what most likely sent a SIGKILL."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = (
            " (most likely out of memory, or the scheduler)" if guess and name == "SIGKILL" else ""
        )
        return f"killed by {name}{hint}"
    return f"exit code {exitcode}"


def ending_in_words(failure: ProcessFailure) -> str:
    """How a rank ended and, if it left one, the last line of its error."""
    ended = exit_in_words(failure.exitcode, guess=False)
    error = last_error_line(failure)
    return f"{ended}: {error}" if error and error != "<NONE>" else ended


def failure_text(failure: ProcessFailure) -> str:
    """The worker's recorded traceback or message, if it left one."""
    # torch annotates `message` as str; it holds the error file's dict when the worker left one.
    recorded: object = failure.message
    message = recorded if isinstance(recorded, str) else ""
    if isinstance(failure.error_file_data, dict):
        message = failure.error_file_data.get("message", {})
        if isinstance(message, dict):
            extra = message.get("extraInfo", {}).get("py_callstack", "")
            message = extra or message.get("message", "")
    return str(message)


def error_tail(failure: ProcessFailure, lines: int = 3) -> str:
    """The end of the worker's recorded traceback, if it left one."""
    # Python 3.11 underlines the failing expression with ^ and ~: no information here.
    text = [line for line in failure_text(failure).strip().splitlines() if line.strip(" ^~")]
    tail = text[-lines:]
    if not tail or tail[-1] == "<NONE>" or "To enable traceback" in tail[-1]:
        return ""
    if tail[-1].startswith("Signal "):
        return ""
    return "\n".join(f"  {line}" for line in tail)


# What a worker that left on the agent's SIGTERM recorded of where it was
# (ddpcli.training.stopping).
LEFT_FOR_PEER = re.compile(
    re.escape(STOPPED_FOR_PEER) + r" while (?P<state>waiting|busy) at (?P<place>.+)"
)


def left_for_peer(process: ProcessFailure) -> re.Match[str] | None:
    return LEFT_FOR_PEER.search(last_error_line(process))


def busy_when_stopped(process: ProcessFailure) -> bool:
    """It left on the agent's SIGTERM busy outside any collective: if the others gave up
    waiting at one, it was the rank they waited for."""
    left = left_for_peer(process)
    return bool(left and left["state"] == "busy")


def stopped_place(rank: int, process: ProcessFailure, stacks: Path | None) -> str | None:
    """Where a rank the agent stopped was: as it recorded when it left, or from its stack."""
    if left := left_for_peer(process):
        return left["place"]
    return stopped_at(stacks, rank) if stacks else None


def stopped_at(stacks: Path, rank: int) -> str | None:
    """Where RANK was when the agent stopped it, from the stack it wrote then
    (ddpcli.stacks)."""
    frame = where_stopped(stacks / stack_file_name(rank))
    return place_in_words(frame) if frame else None


def places_of_stopped_ranks(
    failures: Mapping[int, ProcessFailure], stacks: Path | None
) -> list[str]:
    """One line per place where the ranks the agent stopped were: ranks waiting together at
    a collective share one; a rank stuck elsewhere has its own."""
    places: dict[str, list[int]] = {}
    for rank, process in sorted(failures.items()):
        stopped = process.exitcode == -signal.SIGTERM or left_for_peer(process)
        if stopped and (where := stopped_place(rank, process, stacks)):
            places.setdefault(where, []).append(rank)
    verb = {True: "was", False: "were"}
    return [
        f"  when stopped, {rank_list(ranks)} {verb[len(ranks) == 1]} at {where}"
        for where, ranks in places.items()
    ]
