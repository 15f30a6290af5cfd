"""The agent's side of the records: ask the live ranks for theirs, keep them, judge them.

When a worker fails, its agent asks the node's other ranks for their records (a file in the
records folder, which each rank's watcher sees) and waits a bounded time for them. Once the
job has ended, each node's launcher copies its ranks' records into the run's `collectives/`
folder, named `HOST.rank_N`, and the other nodes post theirs to node 0 on the store of the
nodes' roll call: node 0 finds every node's records in its folder (posted, or left there by
the others on a shared `--out`), and a node whose records never come is named as such in
the verdict. torch's analyzer reads the folder as it is (`fr_trace FOLDER --prefix rank_`).
"""

from __future__ import annotations

import datetime
import pickle
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpcli.collectives.record import RECORD_PREFIX, REQUEST_FILE, record_name
from ddpcli.collectives.verdict import RankRecord, Verdict, decide
from ddpcli.errors import first_line
from ddpcli.files import write_bytes_atomic
from ddpcli.stacks import Frame, main_line, stack_file_name

if TYPE_CHECKING:
    from torch.distributed import Store

# How long the agent waits for its live ranks' records after one failed (a dump takes
# milliseconds; a rank may be slow to see the request on a busy machine), and node 0 for
# the other nodes' records to reach it (posted, or on a shared --out).
RECORDS_WAIT_S = 10.0
OTHER_NODES_WAIT_S = 5.0
KEPT_FOLDER = "collectives"
# A rank's record on node 0's store, posted by the rank's node.
POSTED_PREFIX = "ddpcli/records/"


def request_records(records: Path) -> None:
    (records / REQUEST_FILE).touch()


def clear_records(records: Path) -> None:
    """A new round of workers: no request pending, no record of the last round left."""
    for file in [records / REQUEST_FILE, *record_files(records)]:
        file.unlink(missing_ok=True)


def await_records(records: Path, ranks: list[int], wait_s: float = RECORDS_WAIT_S) -> None:
    """Until the records of RANKS (the live ones) are in RECORDS, or WAIT_S passed (a rank
    stuck where it cannot dump)."""
    deadline = time.monotonic() + wait_s
    files = [records / record_name(rank) for rank in ranks]
    while not all(file.exists() for file in files) and time.monotonic() < deadline:
        time.sleep(0.05)


def record_files(folder: Path) -> list[Path]:
    """The whole records in FOLDER (not one still being written: `.NAME.PID.tmp`)."""
    return sorted(
        file for file in folder.glob(f"*{RECORD_PREFIX}[0-9]*") if not file.name.startswith(".")
    )


def rank_of(file: Path) -> int:
    return int(file.name.rsplit(RECORD_PREFIX, 1)[1])


def keep_records(records: Path, kept: Path) -> list[Path]:
    """This node's ranks' records copied into KEPT, named by host and rank."""
    host = socket.gethostname()
    files = record_files(records)
    if files:
        kept.mkdir(parents=True, exist_ok=True)
    copies = [kept / f"{host}.{file.name}" for file in files]
    for file, copy in zip(files, copies, strict=True):
        # Whole or not at all: node 0 reads a shared --out as the other nodes write to it.
        write_bytes_atomic(copy, file.read_bytes())
    return copies


def post_records(store: Store, files: list[Path], wait_s: float = OTHER_NODES_WAIT_S) -> str | None:
    """This node's ranks' records (FILES) posted to node 0 on its STORE, within WAIT_S (node 0
    waits as long for them); None once they are, else why not (node 0 gone, or unreachable:
    a send to a host cut off blocks, so it is left to a thread the process does not wait for)."""
    failure: list[str] = [f"no answer from node 0 within {wait_s:g}s"]

    def post() -> None:
        keys = [f"{POSTED_PREFIX}{rank_of(file)}" for file in files]
        try:
            store.set_timeout(datetime.timedelta(seconds=wait_s))
            for key, file in zip(keys, files, strict=True):
                record: Any = file.read_bytes()  # the store takes bytes as well as str
                store.set(key, record)
            store.check(keys)  # a set is sent, not answered: this one is, or raises
            failure.clear()
        except (RuntimeError, OSError) as error:
            failure[:] = [first_line(error)]

    sender = threading.Thread(target=post, name="ddpcli-post-records", daemon=True)
    sender.start()
    sender.join(wait_s)
    return failure[0] if failure else None


def take_posted(store: Store, kept: Path, world_size: int) -> None:
    """The records other nodes posted to STORE and KEPT lacks, written into KEPT as a
    shared --out would have them."""
    have = {rank_of(file) for file in record_files(kept)}
    for rank in set(range(world_size)) - have:
        key = f"{POSTED_PREFIX}{rank}"
        if not store.check([key]):
            continue
        posted = store.get(key)
        try:
            host = own(pickle.loads(posted)).get("host") or "node"
        except (ValueError, pickle.UnpicklingError, EOFError):
            continue
        write_bytes_atomic(kept / f"{host}.{record_name(rank)}", posted)


def gathered(
    kept: Path, world_size: int, wait_s: float, store: Store | None = None
) -> dict[int, dict]:
    """Every rank's record in KEPT, waiting up to WAIT_S for those of other nodes (in KEPT
    itself, a shared folder, or posted on STORE)."""
    deadline = time.monotonic() + wait_s
    while True:
        if store is not None:
            try:
                take_posted(store, kept, world_size)
            except RuntimeError:  # the store is gone: what KEPT holds is all there is
                store = None
        if len(record_files(kept)) >= world_size or time.monotonic() >= deadline:
            break
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
    store: Store | None = None,
) -> Verdict | list[int] | None:
    """The verdict on the records in KEPT; or the ranks of which nothing is known (their
    node's records never came); or None when the records show no disagreement. ENDINGS: how
    each rank of this node that failed ended, in words; STACKS: where this node's stopped
    ranks were; OTHER_NODES: records from other nodes may still be on their way, to KEPT or
    to STORE."""
    records = gathered(kept, world_size, OTHER_NODES_WAIT_S if other_nodes else 0.0, store)
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
