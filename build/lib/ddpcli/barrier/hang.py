"""A hung barrier turned into one summary: from the reports and faulthandler stacks the ranks
left behind, who waits where and who never arrived (and where it was last seen)."""

from __future__ import annotations

import json
from pathlib import Path

from ddpcli.barrier.rank import ranks_in_words
from ddpcli.config import BarrierConfig
from ddpcli.errors import RUNTIME, DdpcliError
from ddpcli.stacks import first_frame


class BarrierHang(DdpcliError):
    """The job hung at a barrier: `report` says who waited where and who never came."""

    def __init__(self, report: dict):
        super().__init__(describe_hang(report), RUNTIME)
        self.report = report


# Our own plumbing around a barrier: the place to report is the line that called it.
BARRIER_PLUMBING = {"guarded_barrier", "device_barrier_until", "barrier_timeout"}


def collect_hang(workdir: Path, cfg: BarrierConfig) -> dict | None:
    """What the ranks left when a barrier timed out, or None if it was another failure."""
    reports = [json.loads(path.read_text()) for path in sorted(workdir.glob("hang-*.json"))]
    if not reports:
        return None
    missing = sorted(set().union(*(report["missing"] for report in reports)))
    monitor = next((r["backend_message"] for r in reports if r["rank"] == 0), None)
    ranks = []
    for rank in range(cfg.world_size):
        where = where_rank_is(workdir / f"stack-{rank}.txt")
        ranks.append({"rank": rank, "arrived": rank not in missing, "where": where})
    return {
        "error": "barrier timeout",
        "barrier": reports[0]["barrier"],
        "timeout_s": cfg.timeout,
        "backend": cfg.resolved_backend,
        "missing_ranks": missing,
        "reported_by": sorted(report["rank"] for report in reports),
        "monitor_message": monitor if cfg.resolved_backend == "gloo" else None,
        "ranks": ranks,
    }


def where_rank_is(stack_file: Path) -> dict | None:
    """The line of our code a rank was at, from its faulthandler dump."""
    if not stack_file.exists():
        return None
    return first_frame(stack_file.read_text(), is_barrier_call)


def is_barrier_call(frame: dict) -> bool:
    return "/ddpcli/" in frame["file"] and frame["function"] not in BARRIER_PLUMBING


def describe_hang(report: dict) -> str:
    missing = report["missing_ranks"]
    lines = [
        f"barrier {report['barrier']!r} timed out after {report['timeout_s']:g}s: "
        + (f"{ranks_in_words(missing)} never arrived" if missing else "every rank arrived")
    ]
    if report.get("monitor_message"):
        lines.append(f"  Gloo monitored_barrier on rank 0: {report['monitor_message']}")
    elif report["backend"] == "nccl":
        lines.append("  NCCL: each rank gave up at its deadline; arrivals are from the TCPStore")
    for arrived, places in group_by_place(report["ranks"]).items():
        for place, ranks in places.items():
            lines.append(f"  {ranks_in_words(ranks)} {place_verb(arrived, len(ranks))} {place}")
    lines.append(
        "every rank must call barrier() the same number of times, in the same order "
        "(docs/barrier.md)"
    )
    return "\n".join(lines)


def place_verb(arrived: bool, count: int) -> str:
    if not arrived:
        return "never arrived; last seen at"
    return "waits at" if count == 1 else "wait at"


def group_by_place(ranks: list[dict]) -> dict[bool, dict[str, list[int]]]:
    places: dict[bool, dict[str, list[int]]] = {True: {}, False: {}}
    for entry in ranks:
        where = entry["where"]
        place = "an unknown place (no stack was left)"
        if where:
            short = where["file"][where["file"].rfind("ddpcli/") :]
            place = f"{short}:{where['line']} in {where['function']}(): {where['code']}"
        places[entry["arrived"]].setdefault(place, []).append(entry["rank"])
    return places
