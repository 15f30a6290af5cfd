"""The agent's side of the records: ask the live ranks for theirs, keep them, judge them.

When a worker fails, its agent asks the node's other ranks for their records (a file in the
records folder, which each rank's watcher sees) and waits a bounded time for them. Once the
job has ended, each node's launcher copies its ranks' records into the run's `collectives/`
folder, named `HOST.rank_N`: on a shared `--out` node 0 finds every node's there, and a node
whose records never come is named as such in the verdict. torch's analyzer reads the folder
as it is (`fr_trace FOLDER --prefix rank_`).
"""

from __future__ import annotations

import pickle
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from ddpcli.collectives.record import RECORD_PREFIX, REQUEST_FILE, record_name
from ddpcli.collectives.verdict import RankRecord, Verdict, decide
from ddpcli.stacks import Frame, main_line, stack_file_name

# How long the agent waits for its live ranks' records after one failed, and node 0 for
# the other nodes' records to reach a shared --out. A rank's first dump imports
# torch._inductor (torch reads it as it writes the stacks), seconds where DDP has not
# imported it already (a plain script under `ddpcli launch`), more on a busy machine.
RECORDS_WAIT_S = 10.0
OTHER_NODES_WAIT_S = 5.0
KEPT_FOLDER = "collectives"


def request_records(records: Path) -> None:
    (records / REQUEST_FILE).touch()


def clear_records(records: Path) -> None:
    """A new round of workers: no request pending, no record of the last round left."""
    for file in [records / REQUEST_FILE, *record_files(records)]:
        file.unlink(missing_ok=True)


def await_records(records: Path, ranks: list[int], wait_s: float = RECORDS_WAIT_S) -> None:
    """Until the whole records of RANKS (the live ones) are in RECORDS, or WAIT_S passed (a
    rank stuck where it cannot dump, or slow to find its stacks: its first record, without
    them, is there)."""
    deadline = time.monotonic() + wait_s
    files = [records / record_name(rank) for rank in ranks]
    while not all(map(is_whole, files)) and time.monotonic() < deadline:
        time.sleep(0.05)


def is_whole(file: Path) -> bool:
    """A record with the stacks of its collectives (a rank writes one without them first)."""
    try:
        return bool(pickle.loads(file.read_bytes()).get("ddpcli", {}).get("with_stacks"))
    except (OSError, ValueError, pickle.UnpicklingError, EOFError):
        return False


def record_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{RECORD_PREFIX}[0-9]*"))


def rank_of(file: Path) -> int:
    return int(file.name.rsplit(RECORD_PREFIX, 1)[1])


def keep_records(records: Path, kept: Path) -> list[Path]:
    """This node's ranks' records copied into KEPT, named by host and rank."""
    host = socket.gethostname()
    files = [file for file in record_files(records) if not file.name.startswith(".")]
    if files:
        kept.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copyfile(file, kept / f"{host}.{file.name}")
    return [kept / f"{host}.{file.name}" for file in files]


def gathered(kept: Path, world_size: int, wait_s: float) -> dict[int, dict]:
    """Every rank's record in KEPT, waiting up to WAIT_S for those of other nodes."""
    deadline = time.monotonic() + wait_s
    while len(record_files(kept)) < world_size and time.monotonic() < deadline:
        time.sleep(0.1)
    found: dict[int, dict] = {}
    for file in record_files(kept):
        try:
            found[rank_of(file)] = pickle.loads(file.read_bytes())
        except (OSError, ValueError, pickle.UnpicklingError, EOFError):
            continue  # half a record from a rank that died writing it: none
    return found


def own(record: dict | None) -> dict:
    """What ddpcli adds to a record: the rank's host, and the error it failed on."""
    return (record or {}).get("ddpcli") or {}


def stopped_stack(stacks: Path | None, rank: int) -> list[Frame] | None:
    """Where a stopped rank's main thread was (innermost first), from its faulthandler dump."""
    if stacks is None:
        return None
    try:
        return main_line((stacks / stack_file_name(rank)).read_text(errors="replace")) or None
    except OSError:
        return None


def judged(
    kept: Path,
    world_size: int,
    endings: Mapping[int, str],
    stacks: Path | None,
    other_nodes: bool,
) -> Verdict | list[int] | None:
    """The verdict on the records in KEPT; or the ranks of which nothing is known (their
    node's records never came: no shared --out); or None when the records show no
    disagreement. ENDINGS: how each rank of this node that failed ended, in words; STACKS:
    where this node's stopped ranks were; OTHER_NODES: records from other nodes may still be
    on their way."""
    records = gathered(kept, world_size, OTHER_NODES_WAIT_S if other_nodes else 0.0)
    unknown = [rank for rank in range(world_size) if rank not in records and rank not in endings]
    if unknown and other_nodes:
        return unknown
    rank_records = [
        RankRecord(
            rank=rank,
            host=str(own(records.get(rank)).get("host", "")),
            dump=records.get(rank),
            stack=stopped_stack(stacks, rank) or own(records.get(rank)).get("stack"),
            progress=own(records.get(rank)).get("progress"),
            ended="; ".join(filter(None, [endings.get(rank), own(records.get(rank)).get("error")]))
            or None,
        )
        for rank in range(world_size)
    ]
    return decide(rank_records, world_size)
