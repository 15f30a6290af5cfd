"""Where the ranks parted, and why: one pure function from what the launcher knows of each
rank when the job stopped (its flight-recorder dump, where its main thread was, how it ended)
to a verdict of a few lines. No process, no I/O: it is tested on real dumps kept as fixtures.

Built on torch's own analyzer (`torch.distributed.flight_recorder.components`), imported
lazily: its group memberships (`build_groups_memberships`), its alignment of ring buffers
(`align_trace_from_beginning`) and its reading and matching of one entry against another
(`Op`, `Op.match`, `MatchState`). Not its `build_collectives`: that pairs collectives greedily
from the first rank's view (the culprit it names is whichever rank differs from that one),
needs every member's dump unless told otherwise, logs its findings instead of returning who is
behind, and cannot tell a rank that never issued a collective from one that waits in it; on
Gloo every entry's `state` stays "scheduled", so what a rank finished is read from `retired`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpcli.stacks import Frame, is_users_code, place_in_words
from ddpcli.ui import byte_size

# The flight recorder's dtype names (c10's ScalarType) in torch's words, with their widths.
DTYPES = {
    "Float": ("float32", 4), "Double": ("float64", 8), "Half": ("float16", 2),
    "BFloat16": ("bfloat16", 2), "Long": ("int64", 8), "Int": ("int32", 4),
    "Short": ("int16", 2), "Char": ("int8", 1), "Byte": ("uint8", 1), "Bool": ("bool", 1),
    "ComplexFloat": ("complex64", 8), "ComplexDouble": ("complex128", 16),
    "Float8_e4m3fn": ("float8_e4m3fn", 1), "Float8_e5m2": ("float8_e5m2", 1),
}  # fmt: skip

DDP_GRADIENTS = "DDP's gradient all_reduce"
DDP_BUFFERS = "DDP's buffer broadcast"
DDP_START = "DDP's start-up sync"

CAUSES = {
    "extra_collective": "a collective that only some ranks run: every rank must make the same "
    "collective calls in the same order (a branch on data or on the rank?)",
    "size_mismatch": "the same collective with different sizes: the model or the batch differs "
    "between ranks (a shape that depends on the rank or on the data?)",
    "unused_parameters": "a parameter that got no gradient on some ranks, so DDP never sent "
    "their gradients: pass --find-unused-parameters, or use every parameter on every rank",
    "never_reached": "a rank that never reached the collective its peers waited in: it was "
    "busy elsewhere (loading data, I/O, a lock) for longer than they would wait",
    "uneven_batches": "ranks with different numbers of batches: one ended its epoch while the "
    "others still trained; give every rank the same number of steps (drop the last batch?)",
    "died": "a rank that died",
}


@dataclass(frozen=True)
class RankRecord:
    """What the launcher knows of one rank when the job stopped."""

    rank: int
    host: str
    dump: dict | None  # its flight-recorder dump (repaired), None if it left none
    stack: list[Frame] | None = None  # where its main thread was, innermost first
    ended: str | None = None  # how it ended in words: "killed by SIGKILL", "aborted (SIGABRT)"
    progress: dict | None = None  # {"epoch": 2, "step": 57} when ddpcli's loop knows it


@dataclass(frozen=True)
class RankAt:
    """What one rank ran at the collective where the ranks parted, or why it ran none."""

    rank: int
    state: str  # "ran", "behind" (never issued it), "no record"
    op: str | None = None  # all_reduce
    dtype: str | None = None  # float32
    shape: tuple[int, ...] | None = None
    nbytes: int | None = None
    where: str | None = None  # "model.py:13 in forward()" or "DDP's gradient all_reduce"
    finished: bool = False  # it completed this collective (and may have gone on)
    last_issued: int | None = None
    in_ddp: bool = False  # issued inside DDP's forward or a backward

    def what(self) -> str:
        if self.where in (DDP_GRADIENTS, DDP_BUFFERS, DDP_START):
            return f"{self.where} of {byte_size(self.nbytes or 0)}"
        shape = ",".join(map(str, self.shape or ()))
        return f"{self.op} {self.dtype}[{shape}]" + (f" at {self.where}" if self.where else "")


@dataclass(frozen=True)
class Verdict:
    sequence: int  # the first collective where the ranks part
    group: str  # its process group, as torch names it ("0:default_pg")
    last_agreed: int  # the last collective every rank completed
    ranks: tuple[RankAt, ...]
    odd: tuple[int, ...]  # the odd one(s) out
    behind: tuple[int, ...] = ()  # never issued it
    ahead: tuple[int, ...] = ()  # completed it and went on
    elsewhere: tuple[int, ...] = ()  # issued something else at that number
    cause: str = "extra_collective"
    detail: str | None = None  # where a rank that never reached it is; how a rank ended
    progress: dict | None = field(default=None)

    def rank(self, rank: int) -> RankAt:
        return next(at for at in self.ranks if at.rank == rank)

    def lines(self) -> list[str]:
        odd = [self.rank(rank) for rank in self.odd]
        usual = [at for at in self.ranks if at.rank not in self.odd and at.state == "ran"]
        usual.sort(key=lambda at: at.where is None)  # said with its place, where one is known
        at_usual = f"{usual[0].what()} (#{self.sequence})" if usual else f"#{self.sequence}"
        others = f"{ranks_in_words(sorted(at.rank for at in usual))}"
        lines = []
        for at in odd:
            if at.state == "ran":
                lines.append(
                    f"rank {at.rank} ran {at.what()} (#{self.sequence}), where {others} ran "
                    f"{at_usual}"
                    if usual
                    else f"rank {at.rank} ran {at.what()} (#{self.sequence})"
                )
            elif at.state == "no record":
                lines.append(
                    f"rank {at.rank} left no record ({self.detail or 'ended unseen'}) while "
                    f"{others} waited in {at_usual}; it completed #{self.sequence - 1} as far "
                    "as they tell"
                )
            else:
                place = f": it was at {self.detail}" if self.detail else ""
                lines.append(
                    f"rank {at.rank} never issued #{self.sequence} (its last was "
                    f"#{at.last_issued}), where {others} ran {at_usual}{place}"
                )
        lines.append(f"cause: {CAUSES[self.cause]}")
        if self.cause == "uneven_batches" and self.progress:
            lines.append(f"rank {self.odd[0]} was at {progress_in_words(self.progress)}")
        lines.append(f"the last collective every rank completed: #{self.last_agreed}")
        return lines

    def waited_line(self) -> str:
        """For a rank the launcher already names (dead, or busy elsewhere): the collective
        the others waited in for it."""
        usual = [at for at in self.ranks if at.rank not in self.odd and at.state == "ran"]
        usual.sort(key=lambda at: at.where is None)
        odd = ranks_in_words(list(self.odd))
        if not usual:
            return f"{odd} stopped agreeing with the others at collective #{self.sequence}"
        others = ranks_in_words(sorted(at.rank for at in usual))
        waited = f"{others} waited in {usual[0].what()} (#{self.sequence})"
        if self.cause == "died":
            return f"{waited} for {odd}; it completed #{self.sequence - 1} as far as they tell"
        last = self.rank(self.odd[0]).last_issued
        return f"{waited}, which {odd} never issued (its last was #{last})"

    def to_dict(self) -> dict[str, Any]:
        by_rank = {str(at.rank): at for at in self.ranks}
        return {
            "sequence": self.sequence,
            "group": self.group,
            "op": {rank: at.op for rank, at in by_rank.items()},
            "sizes": {rank: list(at.shape) if at.shape else None for rank, at in by_rank.items()},
            "dtypes": {rank: at.dtype for rank, at in by_rank.items()},
            "where": {rank: at.where for rank, at in by_rank.items()},
            "ranks": {
                rank: {**asdict(at), "shape": None if at.shape is None else list(at.shape)}
                for rank, at in by_rank.items()
            },  # fmt: skip
            "odd": list(self.odd),
            "behind": list(self.behind),
            "ahead": list(self.ahead),
            "elsewhere": list(self.elsewhere),
            "cause": self.cause,
            "detail": self.detail,
            "progress": self.progress,  # the odd rank's epoch and step, where ddpcli's loop ran
            "last_agreed": self.last_agreed,
        }


def ranks_in_words(ranks: Sequence[int]) -> str:
    if not ranks:
        return "no other rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    listed = ", ".join(map(str, ranks[:-1]))
    return f"ranks {listed} and {ranks[-1]}"


def progress_in_words(progress: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in progress.items())


# Frames: the flight recorder's ({"name", "filename", "line"}, innermost first) as ddpcli's.


def as_frames(entry_frames: list[dict]) -> list[Frame]:
    return [
        {"file": frame["filename"], "line": int(frame["line"]), "function": frame["name"]}
        for frame in entry_frames
    ]


def torch_part(file: str) -> str | None:
    """The path inside torch of one of torch's files ("nn/parallel/distributed.py"), read from
    the path itself: a record may come from another machine, whose folders are not ours."""
    marker = os.sep + "torch" + os.sep
    if marker not in file or (is_users_code({"file": file}) and "-packages" + os.sep not in file):
        return None
    return file.rsplit(marker, 1)[1]


def is_theirs(frame: Frame) -> bool:
    """The user's own code (not a library's), also for paths of another machine."""
    file = frame["file"]
    return is_users_code(frame) and not any(
        part in file
        for part in ("site-packages", "dist-packages", os.sep + "lib" + os.sep + "python")
    )


def place(frames: list[Frame]) -> str | None:
    """Where a collective was issued: the innermost frame past torch.distributed's own; in
    words the user's line, or what DDP was doing when DDP issued it."""
    for frame in frames:
        part = torch_part(frame["file"])
        if part is None:
            if is_theirs(frame):
                return place_in_words(frame)
            continue
        if part.startswith("autograd" + os.sep):
            return DDP_GRADIENTS
        if part == os.path.join("nn", "parallel", "distributed.py"):
            return DDP_START if frame["function"] in DDP_START_FUNCTIONS else DDP_BUFFERS
    return next((place_in_words(frame) for frame in frames if is_ddpcli_or_theirs(frame)), None)


DDP_START_FUNCTIONS = {"__init__", "_sync_module_states", "_verify_param_shape_across_processes"}


def in_ddp(frames: list[Frame]) -> bool:
    """A stack inside DDP's forward or a backward: where a rank whose gradients DDP never
    sent goes on (its backward ends, its next forward raises)."""
    for frame in frames:
        part = torch_part(frame["file"]) or ""
        if part.startswith("autograd" + os.sep) or part == os.path.join(
            "nn", "parallel", "distributed.py"
        ):
            return True
    return False


def is_ddpcli_or_theirs(frame: Frame) -> bool:
    return is_theirs(frame) or os.sep + "ddpcli" + os.sep in frame["file"]


def inner_calls(frames: list[Frame]) -> list[Frame]:
    """The library calls made from the innermost line of ddpcli's or the user's code (the
    frames below it, such as the launcher's own entry, are not where the rank waits)."""
    calls = []
    for frame in frames:
        if is_ddpcli_or_theirs(frame):
            break
        calls.append(frame)
    return calls


def in_collective(frames: list[Frame]) -> bool:
    return any(
        (torch_part(frame["file"]) or "").startswith("distributed" + os.sep)
        for frame in inner_calls(frames)
    )


def own_place(frames: list[Frame]) -> str | None:
    """The innermost line of the user's code, else of ddpcli's: where a rank was."""
    mine = users_place(frames)
    if mine is None:
        ddpcli = next((frame for frame in frames if is_ddpcli_or_theirs(frame)), None)
        mine = place_in_words(ddpcli) if ddpcli else None
    return mine


def users_place(frames: list[Frame] | None) -> str | None:
    theirs = [frame for frame in frames or [] if is_theirs(frame)]
    return place_in_words(theirs[0]) if theirs else None


# The verdict.


@dataclass
class Track:
    """One rank's collectives in one group, by sequence number."""

    entries: dict[int, dict]

    @property
    def last_issued(self) -> int:
        return max(self.entries, default=0)

    @property
    def last_completed(self) -> int:
        """The last number up to which every collective it issued was retired (finished)."""
        done = min(self.entries, default=1) - 1
        for sequence in sorted(self.entries):
            if not self.entries[sequence].get("retired"):
                break
            done = sequence
        return done


def tracks(records: Sequence[RankRecord]) -> dict[tuple[str, str], dict[int, Track]]:
    """Per process group (name, desc), each dumped rank's collectives (not p2p), after torch's
    alignment of the ring buffers (entries older than the newest first entry dropped)."""
    from torch.distributed.flight_recorder.components.utils import align_trace_from_beginning

    aligned = align_trace_from_beginning(
        {record.rank: list(record.dump["entries"]) for record in records if record.dump}
    )
    found: dict[tuple[str, str], dict[int, Track]] = {}
    for rank, entries in aligned.items():
        for entry in entries:
            if entry.get("is_p2p"):
                continue
            group = found.setdefault(tuple(entry["process_group"]), {})
            group.setdefault(rank, Track({})).entries[entry["collective_seq_id"]] = entry
    return found


class QuietAboutTabulate(logging.Filter):
    """torch's analyzer warns at import that tabulate (for its own tables) is missing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("tabulate is not installed")


QUIET = QuietAboutTabulate()


def members(records: Sequence[RankRecord], world_size: int) -> dict[str, set[int]]:
    """Each group's ranks, by its name, from the dumps' pg_config (torch's reading)."""
    logging.getLogger("Flight Recorder").addFilter(QUIET)
    from torch.distributed.flight_recorder.components.builder import build_groups_memberships

    config = {record.rank: record.dump["pg_config"] for record in records if record.dump}
    _, _, _, memberships, guids = build_groups_memberships(config)
    found: dict[str, set[int]] = {}
    for (name, _rank), guid in guids.items():
        found.setdefault(name, set()).update(memberships[guid])
    return {name: ranks & set(range(world_size)) for name, ranks in found.items()}


def agrees(entries: list[dict], memberships: dict[str, set[int]], name: str) -> bool:
    """Torch's match of each entry against the first. States are not compared: on NCCL one
    rank's "completed" beside another's "started" is no disagreement."""
    from torch.distributed.flight_recorder.components.types import MatchState, Op

    agreeing = (
        MatchState.FULLY_MATCHED,
        MatchState.UNDECIDED,
        MatchState.COLLECTIVE_STATE_MISMATCH,
    )
    first, *others = (Op(in_nccls_words(entry), memberships, name) for entry in entries)
    return all(first.match(other).state in agreeing for other in others)


def in_nccls_words(entry: dict) -> dict:
    """ENTRY's profiling name as NCCL's records spell it (`gloo:barrier` as
    `nccl:all_reduce_barrier`): torch 2.11's Op accepts only the nccl and xccl backends and no
    plain barrier, so a Gloo record stopped the verdict there. Op matches on the name after
    the backend, so both sides renamed alike match as before."""
    backend, _, op = entry["profiling_name"].partition(":")
    if backend == "nccl" or not op:
        return entry
    op = "all_reduce_barrier" if op == "barrier" else op
    return {**entry, "profiling_name": f"nccl:{op}"}


def parting(group: dict[int, Track], ranks: set[int], name: str) -> int | None:
    """The first sequence number at which the dumped ranks' records differ (one has none of
    it, or torch does not match their entries); else, when some rank left no dump, the one
    its peers wait in (the first they did not all finish), or their last."""
    memberships = {name: ranks}
    dumped = [rank for rank in sorted(ranks) if rank in group]
    last = max((group[rank].last_issued for rank in dumped), default=0)
    # From the first number all records hold: on Gloo a rank may retire a collective its
    # peers disagreed on, so what each finished does not bound the search.
    start = max((min(group[rank].entries, default=1) for rank in dumped), default=1)
    for sequence in range(start, last + 1):
        entries = [group[rank].entries.get(sequence) for rank in dumped]
        present = [entry for entry in entries if entry is not None]
        if len(present) < len(dumped) or not agrees(present, memberships, name):
            return sequence
    if len(dumped) == len(ranks) or not last:
        return None
    return (
        min(group[rank].last_completed for rank in dumped) + 1
        if any(group[rank].last_completed < last for rank in dumped)
        else last
    )


def rank_at(rank: int, group: dict[int, Track], sequence: int) -> RankAt:
    if rank not in group:
        return RankAt(rank, "no record")
    track = group[rank]
    entry = track.entries.get(sequence)
    if entry is None:
        return RankAt(rank, "behind", last_issued=track.last_issued)
    frames = as_frames(entry.get("frames", []))
    shape = tuple(entry["input_sizes"][0]) if entry["input_sizes"] else ()
    dtype, width = DTYPES.get((entry["input_dtypes"] or ["?"])[0], ("?", 0))
    elements = sum(_numel(size) for size in entry["input_sizes"])
    return RankAt(
        rank,
        "ran",
        op=entry["profiling_name"].split(":", 1)[-1].split(" ")[0],  # as torch's Op reads it
        dtype=dtype,
        shape=shape,
        nbytes=elements * width,
        where=place(frames),
        in_ddp=in_ddp(frames),
        finished=bool(entry.get("retired")),
        last_issued=track.last_issued,
    )


def _numel(size: list[int]) -> int:
    count = 1
    for extent in size:
        count *= extent
    return count


def odd_ones(ats: list[RankAt]) -> tuple[int, ...]:
    """The ranks outside the largest set that did the same (ties: the set with the lowest
    rank). Ranks that ran the same op and shape are one set unless they issued it from
    different places; a rank whose record has no stacks joins its op's largest place."""
    kinds: dict[tuple, list[RankAt]] = {}
    for at in ats:
        key = (at.state, at.op, at.shape, at.dtype) if at.state == "ran" else (at.state,)
        kinds.setdefault(key, []).append(at)
    sets: list[list[int]] = []
    for members in kinds.values():
        places: dict[str | None, list[int]] = {}
        for at in members:
            places.setdefault(at.where, []).append(at.rank)
        unplaced = places.pop(None, [])
        if places:
            largest(list(places.values())).extend(unplaced)
            sets.extend(places.values())
        else:
            sets.append(unplaced)
    usual = largest(sets)
    return tuple(at.rank for at in ats if at.rank not in usual)


def largest(sets: list[list[int]]) -> list[int]:
    return max(sets, key=lambda ranks: (len(ranks), -min(ranks)))


def decide(records: Sequence[RankRecord], world_size: int) -> Verdict | None:
    """Where the ranks parted and why, or None when their records show no disagreement."""
    if not any(record.dump for record in records):
        return None
    by_rank = {record.rank: record for record in records}
    groups = tracks(records)
    memberships = members(records, world_size)
    for (name, desc), group in sorted(groups.items()):
        ranks = memberships.get(name) or set(range(world_size))
        sequence = parting(group, ranks, name)
        if sequence is not None:
            return judge(group, sorted(ranks), sequence, f"{name}:{desc}", by_rank)
    return None


def judge(
    group: dict[int, Track],
    ranks: list[int],
    sequence: int,
    group_name: str,
    records: dict[int, RankRecord],
) -> Verdict:
    ats = [rank_at(rank, group, sequence) for rank in ranks]
    # A rank known dead is the cause: where the live ones were is its consequence (one
    # still loading its batch, another already waiting in the collective).
    odd = dead_ranks(ats, records) or odd_ones(ats)
    usual = next((at for at in ats if at.rank not in odd and at.state == "ran"), None)
    behind = tuple(at.rank for at in ats if at.state == "behind")
    ahead = tuple(
        at.rank for at in ats if at.finished and (at.last_issued or 0) > sequence and behind
    )
    elsewhere = tuple(at.rank for at in ats if at.state == "ran" and at.rank in odd)
    cause, detail, progress = cause_of([at for at in ats if at.rank in odd], usual, records)
    last_agreed = min((group[rank].last_completed for rank in ranks if rank in group), default=0)
    return Verdict(
        sequence=sequence,
        group=group_name,
        last_agreed=min(last_agreed, sequence - 1),
        ranks=tuple(ats),
        odd=odd,
        behind=behind,
        ahead=ahead,
        elsewhere=elsewhere,
        cause=cause,
        detail=detail,
        progress=progress,
    )


def dead_ranks(ats: list[RankAt], records: dict[int, RankRecord]) -> tuple[int, ...]:
    """The ranks that left no record and ended, as this node saw them."""
    return tuple(
        at.rank
        for at in ats
        if at.state == "no record" and at.rank in records and records[at.rank].ended
    )


def cause_of(
    odd: list[RankAt], usual: RankAt | None, records: dict[int, RankRecord]
) -> tuple[str, str | None, dict | None]:
    """The cause's key, the detail its line names, and the odd rank's progress."""
    at = odd[0]
    record = records.get(at.rank)
    stack = (record.stack if record else None) or []
    progress = record.progress if record else None
    gradients = usual is not None and usual.where == DDP_GRADIENTS
    if at.state == "no record":
        return "died", record.ended if record else None, progress
    if at.state == "behind":
        ended = (record.ended if record else None) or ""
        if gradients and (in_ddp(stack) or "find_unused_parameters" in ended):
            return "unused_parameters", users_place(stack), progress
        if stack and not in_collective(stack):
            return "never_reached", own_place(stack) or place_in_words(stack[0]), progress
        return "extra_collective", users_place(stack), progress
    if usual and usual.op == at.op and usual.where == at.where:
        return "size_mismatch", None, progress
    if gradients and not at.in_ddp and uneven(at, records):
        return "uneven_batches", None, progress
    return "extra_collective", None, progress


def uneven(at: RankAt, records: dict[int, RankRecord]) -> bool:
    """A rank that ran a collective of its own outside the model while the others still ran
    DDP's gradient all_reduce: its epoch ended first (told by its progress when known)."""
    mine = records[at.rank].progress if at.rank in records else None
    others = [r.progress for rank, r in records.items() if rank != at.rank and r.progress]
    return not (mine and others) or any(other != mine for other in others)
