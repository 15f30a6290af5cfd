"""The collective verdict on real flight-recorder dumps of 3 Gloo ranks, kept as fixtures
(tests/fixtures/collectives/make_records.py made them; their frames point at its lines,
found here by its marker comments)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from conftest import ANALYZER_READS_GLOO

from ddpcli.collectives.record import repaired_dump
from ddpcli.collectives.verdict import RankRecord, decide, in_nccls_words

FIXTURES = Path(__file__).parent / "fixtures" / "collectives"
SCRIPT = FIXTURES / "make_records.py"


def marker_line(name: str) -> int:
    lines = SCRIPT.read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if f"# marker: {name}" in line)


def records(scenario: str, **changes: dict) -> list[RankRecord]:
    facts = json.loads((FIXTURES / scenario / "ranks.json").read_text())
    found = []
    for rank in range(3):
        path = FIXTURES / scenario / f"rank_{rank}"
        fact = {"stack": facts[str(rank)]["stack"], "ended": facts[str(rank)]["ended"]}
        fact.update(changes.get(str(rank), {}))
        dump = pickle.loads(path.read_bytes()) if path.exists() else None
        found.append(RankRecord(rank, "localhost", dump, **fact))
    return found


def at_marker(where: str | None, name: str) -> bool:
    return where is not None and f"make_records.py:{marker_line(name)} " in where


def test_an_extra_all_reduce_on_one_rank():
    verdict = decide(records("extra_collective"), 3)
    assert verdict is not None
    assert (verdict.cause, verdict.odd, verdict.sequence) == ("extra_collective", (1,), 5)
    odd, usual = verdict.rank(1), verdict.rank(0)
    assert (odd.op, odd.dtype, odd.shape) == ("all_reduce", "float32", (3,))
    assert at_marker(odd.where, "extra-all-reduce")
    assert usual.where == verdict.rank(2).where == "DDP's gradient all_reduce"
    assert verdict.last_agreed == 4
    assert "rank 1 ran all_reduce float32[3]" in verdict.lines()[0]
    json.dumps(verdict.to_dict())


def test_a_size_that_depends_on_the_rank():
    verdict = decide(records("size_mismatch"), 3)
    assert verdict is not None
    assert (verdict.cause, verdict.odd, verdict.sequence) == ("size_mismatch", (2,), 5)
    assert (verdict.rank(2).shape, verdict.rank(0).shape) == ((5,), (4,))
    assert verdict.rank(2).op == "all_reduce"
    assert at_marker(verdict.rank(2).where, "size-mismatch")
    assert verdict.rank(0).where == verdict.rank(2).where


def test_a_parameter_unused_on_one_rank():
    verdict = decide(records("unused_parameters"), 3)
    assert verdict is not None
    assert (verdict.cause, verdict.odd, verdict.behind) == ("unused_parameters", (1,), (1,))
    assert verdict.sequence == 5 and verdict.rank(0).op == "all_reduce"
    assert verdict.rank(0).where == "DDP's gradient all_reduce"
    assert at_marker(verdict.detail, "ddp-forward")
    assert any("--find-unused-parameters" in line for line in verdict.lines())


def test_a_rank_that_sleeps_before_the_collective():
    sleeping = [
        {"file": "/usr/lib/python3.11/threading.py", "line": 320, "function": "wait"},
        {"file": str(SCRIPT), "line": marker_line("sleep"), "function": "never_reached"},
    ]
    verdict = decide(records("never_reached", **{"2": {"stack": sleeping}}), 3)
    assert verdict is not None
    assert (verdict.cause, verdict.odd, verdict.behind) == ("never_reached", (2,), (2,))
    assert verdict.sequence == 5 and verdict.rank(0).op == "all_reduce"
    assert at_marker(verdict.rank(0).where, "waited-all-reduce")
    assert at_marker(verdict.detail, "sleep")


def test_a_rank_killed_leaves_no_record():
    verdict = decide(records("died"), 3)
    assert verdict is not None
    assert (verdict.cause, verdict.odd, verdict.sequence) == ("died", (1,), 6)
    assert verdict.detail == "killed by SIGKILL"
    assert verdict.last_agreed == 5
    assert verdict.rank(0).op == "all_reduce"
    assert at_marker(verdict.rank(0).where, "survivors-all-reduce")
    assert verdict.to_dict()["last_agreed"] == 5


def test_no_verdict_without_dumps_or_without_disagreement():
    assert decide([RankRecord(rank, "h", None, ended="killed") for rank in range(3)], 3) is None
    agreed = records("size_mismatch")[0].dump
    assert agreed is not None
    same = [RankRecord(rank, "h", agreed) for rank in range(3)]
    assert decide(same, 3) is None


def test_gloo_pg_config_is_keyed_by_the_entries_group():
    dump = {
        "version": "2.10",
        "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1, 2]"}},
        "entries": [{"process_group": ("0", "default_pg")}],
    }
    assert repaired_dump(dump)["pg_config"] == {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}
    }


def test_gloo_records_are_matched_in_nccls_words():
    """torch 2.11's Op takes only NCCL's (and XCCL's) names; the fixtures are Gloo's, so the
    tests above exercise the renaming on any torch, and this pins what it renames."""
    named = {name: in_nccls_words({"profiling_name": name})["profiling_name"] for name in (
        "gloo:barrier", "gloo:all_reduce", "nccl:all_reduce", "nccl:all_reduce_barrier",
    )}  # fmt: skip
    assert named == {
        "gloo:barrier": "nccl:all_reduce_barrier",
        "gloo:all_reduce": "nccl:all_reduce",
        "nccl:all_reduce": "nccl:all_reduce",
        "nccl:all_reduce_barrier": "nccl:all_reduce_barrier",
    }


@ANALYZER_READS_GLOO
@pytest.mark.parametrize("scenario", ["extra_collective", "size_mismatch", "died"])
def test_the_dumps_open_in_torchs_analyzer(scenario):
    from torch.distributed.flight_recorder.fr_trace import main

    main([str(FIXTURES / scenario), "--prefix", "rank_", "--allow-incomplete-ranks"])
