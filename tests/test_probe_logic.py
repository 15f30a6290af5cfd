"""The probe's logic without its processes: the plan, what the parent makes of each rank's
stage log, the rows from every rank's outcome, the roll call and the outcome exchange
through an in-memory store. Each test checks the status and the words a user reads."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpcli.checkenv import probe, probe_ranks, probe_rows
from ddpcli.checkenv.facts import Gpu, Master, NodeFacts
from ddpcli.checkenv.probe_plan import (
    CPU_MESSAGE_BYTES,
    GPU_MESSAGE_BYTES,
    ProbePlan,
    ProbeRequest,
    RankLayout,
    plan_probe,
    probe_backend,
    stage_file,
)
from ddpcli.checkenv.probe_ranks import LocalRank
from ddpcli.config.checkenv import CheckEnvOptions, build_check_options
from ddpcli.errors import DdpcliError
from ddpcli.launcher import engine, rollcall, store_address
from ddpcli.launcher.rollcall import MasterUnreachable, NodeZeroGaveUp, RollCall

LOCAL_MASTER = Master("127.0.0.1", 29500, "127.0.0.1", True, "lo")
REMOTE_MASTER = Master("10.0.0.1", 29500, "10.0.0.1", False, "eth0")
NODE0 = {"node_rank": 0, "host": "h0", "address": "10.0.0.1", "nproc": 2, "nnodes": 2}
NODE1 = {"node_rank": 1, "host": "h1", "address": "10.0.0.2", "nproc": 2, "nnodes": 2}


def node(visible_gpus: int = 0, **backends: bool) -> NodeFacts:
    gpus = [Gpu(i, "H100", 81559, f"GPU-{i}", i) for i in range(visible_gpus)]
    return NodeFacts(
        host="h0",
        host_address="10.0.0.1",
        versions={"python": "3.11", "torch": "2.14", "cuda": "13.0", "cudnn": "", "nccl": ""},
        backends={"gloo": True, "nccl": True, "mpi": False, **backends},
        cuda_available=visible_gpus > 0,
        gpus=gpus,
        physical_known=True,
        visible_gpus=visible_gpus,
        cuda_visible_devices=None,
        invalid_visible_entries=[],
        interfaces=[],
        environment={},
    )


def options(**flags) -> CheckEnvOptions:
    return build_check_options({"probe": True, **flags}, environ={})


def plan(**changes) -> ProbePlan:
    values = dict(
        backend="gloo", nproc=2, nnodes=2, node_rank=1, master_addr="10.0.0.1",
        master_port=29500, ifname=None, join_timeout=0.05, stage_timeout=15.0,
    )  # fmt: skip
    return ProbePlan(**{**values, **changes})


# --- The plan --------------------------------------------------------------------------------


def test_plan_on_the_cpu_runs_two_gloo_processes_on_a_free_port():
    found = plan_probe(options(), node(), LOCAL_MASTER)
    assert (found.backend, found.nproc, found.master_port) == ("gloo", 2, 0)
    assert found.master_addr == "127.0.0.1" and found.hosts_store and not found.use_gpus


def test_plan_with_gpus_runs_nccl_one_process_per_gpu():
    found = plan_probe(options(), node(visible_gpus=4), LOCAL_MASTER)
    assert (found.backend, found.nproc) == ("nccl", 4) and found.use_gpus


def test_plan_keeps_a_given_port_and_nproc():
    found = plan_probe(options(master_port=1234, nproc=3), node(), LOCAL_MASTER)
    assert (found.master_port, found.nproc) == (1234, 3)


def test_plan_on_one_node_ignores_a_master_elsewhere():
    found = plan_probe(options(master_addr="10.0.0.1"), node(), REMOTE_MASTER)
    assert found.master_addr == "127.0.0.1"


def test_plan_on_several_nodes_uses_the_masters_address_and_port():
    opts = options(nnodes=2, node_rank=1, master_addr="node0", timeout=7, stage_timeout=2)
    master = Master("node0", 29500, "10.0.0.1", False, "eth0")
    found = plan_probe(opts, node(), master)
    assert (found.master_addr, found.master_port) == ("10.0.0.1", 29500)
    assert (found.join_timeout, found.stage_timeout, found.hosts_store) == (7, 2, False)


def test_plan_on_several_nodes_needs_a_master_that_resolves():
    opts = options(nnodes=2, master_addr="nohost")
    row = plan_probe(opts, node(), Master("nohost", 29500, None, False, None))
    assert row.status == "fail" and row.detail == "nohost does not resolve"


def test_probe_backend_nccl_without_gpus_is_a_failed_row():
    row = probe_backend(options(backend="nccl"), node())
    assert row.name == "probe" and row.status == "fail"
    assert "--backend nccl needs GPUs and an NCCL build of torch; this node has 0" in row.detail
    assert row.fix == "use --backend gloo (or auto) on the CPU"


def test_probe_backend_gloo_on_gpus_when_asked():
    assert probe_backend(options(backend="gloo"), node(visible_gpus=2)) == "gloo"
    assert probe_backend(options(), node(visible_gpus=2, nccl=False)) == "gloo"


def test_probe_backend_without_gloo_is_a_failed_row():
    row = probe_backend(options(), node(gloo=False))
    assert row.status == "fail" and row.detail == "Gloo is not in this torch build"


def test_budgets_grow_with_the_pairs_of_gpus():
    budgets = plan(stage_timeout=10).budgets(largest_node=4)
    assert budgets["init"] == 15 and budgets["bandwidth"] == 20 and budgets["start"] == 60
    assert budgets["p2p"] == 10 + 2 * 6


def test_rank_layout_numbers_node_after_node():
    layout = RankLayout([2, 3])
    assert layout.world_size == 5 and layout.ranks_of(0) == [0, 1]
    assert layout.ranks_of(1) == [2, 3, 4]


def test_request_round_trips_through_its_file(tmp_path):
    request = ProbeRequest.for_plan(plan(backend="nccl"), RankLayout([2, 2]), tmp_path, 42)
    assert request.message_bytes == GPU_MESSAGE_BYTES and request.node_ranks == [[0, 1], [2, 3]]
    again = ProbeRequest.read(request.write())
    assert again == request and again.parent_pid == 42
    cpu = ProbeRequest.for_plan(plan(), RankLayout([1]), tmp_path, 42)
    assert cpu.message_bytes == CPU_MESSAGE_BYTES and not cpu.use_gpus


# --- Stage logs and rank outcomes ------------------------------------------------------------


class FakeProcess:
    def __init__(self, returncode: int | None):
        self.returncode = returncode
        self.pid = -1

    def poll(self) -> int | None:
        return self.returncode


def worker(tmp_path: Path, records: list[dict], code: int | None = 0, log: str = "", **flags):
    path = stage_file(tmp_path, 0)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    log_file = tmp_path / "rank-0.log"
    log_file.write_text(log)
    return LocalRank(0, 0, FakeProcess(code), log_file, path, **flags)


def began(stage: str, t: float = 100.0) -> dict:
    return {"stage": stage, "event": "begin", "t": t}


def ended(stage: str, passed: bool = True, detail: str = "", **data) -> dict:
    return {"stage": stage, "event": "end", "ok": passed, "seconds": 0.5, "detail": detail,
            "data": data}  # fmt: skip


STARTED = ended("start")
BUDGETS = {"init": 20.0, "barrier": 15.0}


def test_stage_log_reader_skips_a_line_still_being_written(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    path.write_text(json.dumps(STARTED) + "\n" + json.dumps(began("init")) + '\n{"stage": "in')
    assert [r["event"] for r in probe_ranks.read_stage_log(path)] == ["end", "begin"]
    assert probe_ranks.open_stage(path) == ("init", 100.0)
    assert probe_ranks.read_stage_log(tmp_path / "missing.jsonl") == []


def test_open_stage_is_the_last_begun_and_not_ended(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    records = [STARTED, began("init", 1), ended("init"), began("all_reduce", 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert probe_ranks.open_stage(path) == ("all_reduce", 2)
    assert [r["stage"] for r in probe_ranks.ended_stages(path)] == ["start", "init"]


def test_outcome_of_a_rank_that_passed_everything(tmp_path):
    records = [STARTED, began("init"), ended("init", detail="gloo, cpu", device="cpu")]
    outcome = probe_ranks.rank_outcome(worker(tmp_path, records), BUDGETS, NODE1)
    assert (outcome["rank"], outcome["node_rank"], outcome["host"]) == (0, 1, "h1")
    assert outcome["exit_code"] == 0
    assert [(s["stage"], s["ok"]) for s in outcome["stages"]] == [("start", True), ("init", True)]
    assert outcome["stages"][1]["data"] == {"device": "cpu"}


def test_outcome_of_a_rank_stopped_for_running_late(tmp_path):
    late = worker(tmp_path, [STARTED, began("init")], code=-15, stopped_late=True)
    stage = probe_ranks.rank_outcome(late, BUDGETS, NODE0)["stages"][-1]
    assert stage == {
        "stage": "init",
        "ok": False,
        "detail": "still running after 20s: stopped by the probe",
    }


def test_outcome_of_a_rank_stopped_after_another_failed(tmp_path):
    stopped = worker(tmp_path, [STARTED, began("barrier")], code=-15, stopped=True)
    stage = probe_ranks.rank_outcome(stopped, BUDGETS, NODE0)["stages"][-1]
    assert stage["stage"] == "barrier"
    assert stage["detail"] == "stopped after another rank failed or ran late"


def test_outcome_of_a_rank_that_died_in_a_stage_quotes_its_last_lines(tmp_path):
    log = "Traceback\nframe #0: junk\nRuntimeError: Connection reset by peer\n"
    died = worker(tmp_path, [STARTED, began("all_reduce")], code=1, log=log)
    stage = probe_ranks.rank_outcome(died, BUDGETS, NODE0)["stages"][-1]
    assert stage["stage"] == "all_reduce"
    assert stage["detail"] == "exit code 1: Traceback | RuntimeError: Connection reset by peer"


def test_outcome_of_a_rank_that_never_started(tmp_path):
    silent = worker(tmp_path, [], code=-9)
    outcome = probe_ranks.rank_outcome(silent, BUDGETS, NODE0)
    assert outcome["stages"] == [{"stage": "start", "ok": False, "detail": "killed by signal 9"}]


def test_outcome_of_a_rank_that_failed_on_exit_after_every_stage(tmp_path):
    records = [STARTED, began("init"), ended("init")]
    outcome = probe_ranks.rank_outcome(worker(tmp_path, records, code=3), BUDGETS, NODE0)
    assert outcome["stages"][-1] == {"stage": "exit", "ok": False, "detail": "exit code 3"}


def test_log_tail_drops_cpp_frames_and_keeps_it_short(tmp_path):
    path = tmp_path / "log"
    path.write_text(
        "a\nframe #1: x\nException raised from y\n<omitting python frames>\n" + "b" * 900
    )
    tail = probe_ranks.log_tail(path)
    assert tail.startswith("a | bbb") and len(tail) == 400
    assert probe_ranks.log_tail(tmp_path / "missing") == ""


def test_a_rank_that_logged_a_failed_stage_counts_as_failed(tmp_path):
    records = [STARTED, began("init"), ended("init", passed=False, detail="refused")]
    assert probe_ranks.worker_failed(worker(tmp_path, records, code=None))
    assert not probe_ranks.worker_failed(worker(tmp_path, [STARTED], code=None))
    assert probe_ranks.worker_failed(worker(tmp_path, [STARTED], code=2))


def test_running_late_counts_from_the_open_stage(tmp_path):
    running = worker(tmp_path, [STARTED, began("init", 100.0)], code=None)
    assert not probe_ranks.running_late(running, BUDGETS, now=100 + 20 + 4.9)
    assert probe_ranks.running_late(running, BUDGETS, now=100 + 20 + 5.1)
    done = worker(tmp_path, [STARTED, began("init", 100.0)], code=0)
    assert not probe_ranks.running_late(done, BUDGETS, now=1e9)


def test_a_silent_worker_is_late_after_the_start_budget(tmp_path):
    silent = worker(tmp_path, [], code=None, spawned_at=0.0)
    assert not probe_ranks.running_late(silent, BUDGETS, now=64.0)
    assert probe_ranks.running_late(silent, BUDGETS, now=66.0)


def test_unknown_outcomes_cover_every_rank_of_the_node():
    outcomes = probe_ranks.unknown_outcomes(RankLayout([2, 2]), NODE1, "sent no report")
    assert [(o["rank"], o["local_rank"]) for o in outcomes] == [(2, 0), (3, 1)]
    assert outcomes[0]["stages"] == [{"stage": "report", "ok": False, "detail": "sent no report"}]


def test_the_workers_stage_log_is_what_the_parent_reads(tmp_path):
    from ddpcli.checkenv.probe_worker import StageFailed, StageLog, StageResult, run_stage

    log = StageLog(stage_file(tmp_path, 0), {"init": 60.0, "barrier": 0.0})
    log.started(0.25)
    assert run_stage(log, "init", lambda: StageResult("gloo, cpu", {"device": "cpu"}, 7)) == 7

    def refused() -> StageResult:
        raise RuntimeError("Connection refused\nmore lines")

    with pytest.raises(StageFailed):
        run_stage(log, "all_reduce", refused)
    log.begin("barrier")
    assert log.overdue() == ("barrier", 0.0)
    assert log.end("barrier", False, "timed out after 0s")  # the watchdog closes it...
    assert not log.end("barrier", True, "late")  # ...and the stage's own end is ignored
    stages = probe_ranks.ended_stages(log.path)
    assert [(s["stage"], s["ok"], s["detail"]) for s in stages] == [
        ("start", True, ""),
        ("init", True, "gloo, cpu"),
        ("all_reduce", False, "Connection refused"),
        ("barrier", False, "timed out after 0s"),
    ]
    assert probe_ranks.open_stage(log.path) == (None, 0.0)


def test_a_ddpcli_error_in_a_stage_keeps_its_message(tmp_path):
    from ddpcli.checkenv.probe_worker import StageFailed, StageLog, run_stage

    log = StageLog(stage_file(tmp_path, 0), {"init": 60.0})

    def no_gpu():
        raise DdpcliError("local rank 1 has no GPU: this process sees 1")

    with pytest.raises(StageFailed):
        run_stage(log, "init", no_gpu)
    (stage,) = probe_ranks.ended_stages(log.path)
    assert stage["detail"] == "local rank 1 has no GPU: this process sees 1"


def test_the_measuring_stages_on_a_group_of_one(tmp_path):
    """Barrier and bandwidth through ddpcli.timing, with the JSON keys the report keeps."""
    import torch
    import torch.distributed as dist

    from ddpcli.checkenv import probe_worker
    from ddpcli.dist import DistContext

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = DistContext(0, 0, 1, 1, 0, torch.device("cpu"), "gloo")
        assert probe_worker.check_all_reduce(ctx).detail == "exact"
        barrier = probe_worker.measure_barrier(ctx)
        assert set(barrier.data) == {"p50_us", "p90_us", "max_us"}
        assert 0 < barrier.data["p50_us"] <= barrier.data["p90_us"] <= barrier.data["max_us"]
        assert barrier.detail == f"p50 {barrier.data['p50_us']:.0f} µs"
        bandwidth = probe_worker.measure_bandwidth(ctx, 1 << 20)
        assert set(bandwidth.data) == {"bytes", "ms", "algbw_gbps", "busbw_gbps"}
        assert bandwidth.data["busbw_gbps"] == 0 and bandwidth.data["algbw_gbps"] > 0
        assert bandwidth.detail.startswith("1 MiB in ")
        assert bandwidth.detail.endswith("ms (one rank: no traffic)")
    finally:
        dist.destroy_process_group()


# --- Rows from the outcomes ------------------------------------------------------------------


def outcome(rank: int, node_: dict, stages: list[dict]) -> dict:
    return {**{k: node_[k] for k in ("node_rank", "host", "address")}, "rank": rank,
            "local_rank": rank % 2, "exit_code": 0, "stages": stages}  # fmt: skip


def passed(stage: str, detail: str = "", seconds: float = 0.5, **data) -> dict:
    return {"stage": stage, "ok": True, "seconds": seconds, "detail": detail, "data": data}


def failed(stage: str, detail: str) -> dict:
    return {"stage": stage, "ok": False, "seconds": 1.0, "detail": detail, "data": {}}


GOOD = [
    passed("start"),
    passed("init", "gloo, cpu", seconds=1.25),
    passed("all_reduce", "exact"),
    passed("facts"),
    passed("barrier", p50_us=480.0, p90_us=700.0, max_us=1200.0),
    passed("bandwidth", "16 MiB in 3.0 ms: 10.00 GB/s bus bandwidth"),
    passed("p2p", node_pairs=1),
]


def test_stage_rows_when_every_rank_passed():
    outcomes = [outcome(0, NODE0, GOOD), outcome(1, NODE0, GOOD), outcome(2, NODE1, GOOD)]
    rows = {row.name: row for row in probe_rows.stage_rows(outcomes)}
    assert "worker start" not in rows
    assert all(row.status == "ok" for row in rows.values())
    assert rows["process group"].detail == "3 rank(s) joined (gloo, cpu) in 1.2s"
    assert rows["all_reduce result"].detail == "the sum over 3 rank(s) is exact on every rank"
    assert rows["rank facts"].detail == "gathered from 3 rank(s) on 2 node(s)"
    assert rows["barrier latency"].detail == "p50 480 µs, max 1200 µs (slowest rank, 20 barriers)"
    assert rows["all_reduce bandwidth"].detail == "16 MiB in 3.0 ms: 10.00 GB/s bus bandwidth"
    assert rows["GPU peer-to-peer"].detail == (
        "every pair of GPUs on each node (2 pair(s)) swapped data intact; "
        "transport: direct peer access (NVLink or PCIe) on every pair"
    )


def test_gpu_pairs_without_peer_access_warn_that_nccl_goes_through_host_memory():
    """Such a pair swaps its data intact too: only CUDA's peer-access answer tells."""
    stages = [*GOOD[:-1], passed("p2p", node_pairs=1, host_memory=[[0, 1]], direct=[])]
    outcomes = [outcome(0, NODE0, stages), outcome(1, NODE0, GOOD)]
    row = {row.name: row for row in probe_rows.stage_rows(outcomes)}["GPU peer-to-peer"]
    assert row.status == "warn"
    assert "GPU pair(s) 0-1 on node 0 have no CUDA peer access: NCCL moves their data " in (
        row.detail
    )
    assert "through host memory" in row.detail and "nvidia-smi topo -m" in row.fix


def test_peer_access_is_asked_of_cuda_for_each_pair(monkeypatch):
    import torch

    from ddpcli.checkenv import probe_worker
    from ddpcli.dist import DistContext

    asked = []

    def can_access(device: int, peer: int) -> bool:
        asked.append((device, peer))
        return peer != 2  # GPU 2 sits behind the other CPU socket

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", can_access)
    # Global ranks 4, 5, 6, 7 on this node; rank 5 drives cuda:1.
    ctx = DistContext(5, 1, 8, 4, 1, torch.device("cuda", 1), "nccl")
    access = probe_worker.peer_access(ctx, [4, 5, 6, 7])
    assert asked == [(1, 2)]
    assert access == {"direct": [], "host_memory": [[1, 2]], "unknown": [[1, 3]]}


def test_bandwidth_is_timed_after_a_barrier_over_at_least_20_operations(monkeypatch):
    import torch

    from ddpcli.checkenv import probe_worker
    from ddpcli.dist import DistContext

    calls: list[str] = []
    monkeypatch.setattr(probe_worker.dist, "all_reduce", lambda tensor: calls.append("op"))
    monkeypatch.setattr(probe_worker.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(probe_worker, "synced_clock", lambda device: calls.append("clock") or 0.0)
    ctx = DistContext(0, 0, 2, 2, 0, torch.device("cpu"), "gloo")
    probe_worker.measure_bandwidth(ctx, 1 << 10)
    assert calls[:3] == ["op", "barrier", "clock"]  # warm-up, then every rank lined up
    assert calls[3:-1] == ["op"] * probe_worker.BANDWIDTH_ITERATIONS and calls[-1] == "clock"
    assert probe_worker.BANDWIDTH_ITERATIONS >= 20


def test_a_failed_stage_groups_ranks_by_reason_with_its_fix():
    refused = [passed("start"), failed("init", "rank 0: Connection refused")]
    other = [passed("start"), failed("init", "rank 2: timed out")]
    outcomes = [outcome(0, NODE0, refused), outcome(1, NODE0, refused), outcome(2, NODE1, other)]
    (row,) = probe_rows.stage_rows(outcomes)
    assert row.name == "process group" and row.status == "fail"
    assert row.detail == (
        "ranks 0,1 on node 0 (h0, 10.0.0.1): Connection refused; "
        "rank 2 on node 1 (h1, 10.0.0.2): timed out"
    )
    assert row.fix == probe_rows.STAGE_FIXES["init"]


def test_a_worker_that_did_not_start_gets_a_start_row():
    (row,) = probe_rows.stage_rows([outcome(0, NODE0, [failed("start", "exit code 1: No module")])])
    assert row.name == "worker start" and row.status == "fail"
    assert "same Python environment" in row.fix


def test_exit_and_report_rows_come_after_the_stages():
    outcomes = [
        outcome(0, NODE0, [*GOOD[:3], failed("exit", "exit code 3")]),
        outcome(2, NODE1, [failed("report", "sent no report")]),
    ]
    names = [row.name for row in probe_rows.stage_rows(outcomes)]
    assert names[-2:] == ["exit", "report"]


def test_many_reasons_are_cut_to_three():
    outcomes = [outcome(r, NODE0, [failed("barrier", f"reason {r}")]) for r in range(5)]
    detail = probe_rows.describe_failures(
        [(o, o["stages"][0]) for o in outcomes]  # one reason per rank
    )
    assert detail.endswith("reason 2; and 2 more") and "reason 3" not in detail


def test_clean_detail_drops_the_rank_and_cpp_locations():
    detail = "rank 3: [enforce fail at /pytorch/gloo/pair.cc:446] Connection closed by peer"
    assert probe_rows.clean_detail(detail) == "Connection closed by peer"
    assert probe_rows.clean_detail("[/src/x.cpp:12] boom") == "boom"


def test_failure_hint_names_a_loopback_address():
    remote = failed("init", "Connection refused remote=[127.0.1.1]:4000")
    hint = probe_rows.failure_hint([(outcome(0, NODE0, [remote]), remote)])
    assert hint.startswith("a rank advertised a loopback address") and "--ifname" in hint
    plain = failed("init", "timed out")
    loop = {**NODE0, "address": "127.0.0.1"}
    assert "loopback" in probe_rows.failure_hint([(outcome(0, loop, [plain]), plain)])


def test_failure_hint_names_an_interface_without_address():
    record = failed("init", "Unable to find address for: eth9")
    hint = probe_rows.failure_hint([(outcome(0, NODE0, [record]), record)])
    assert hint.startswith("the interface named for Gloo/NCCL holds no address or is down")


def test_failure_hint_is_empty_when_the_error_says_nothing():
    record = failed("init", "timed out")
    assert probe_rows.failure_hint([(outcome(0, NODE0, [record]), record)]) == ""


def test_rank_rows_mark_each_stage():
    bad = [passed("start"), passed("init"), failed("all_reduce", "wrong sum")]
    rows = probe_rows.rank_rows([outcome(0, NODE0, GOOD[:3]), outcome(1, NODE0, bad)])
    assert rows[0].status == "ok"
    assert rows[0].detail == "node 0 (h0, 10.0.0.1) · init ✓ all_reduce ✓"
    assert rows[1].name == "rank 1" and rows[1].status == "fail"
    assert rows[1].detail.endswith("init ✓ all_reduce ✗")
    assert rows[1].fix == "see the failed stage above"
    (start,) = probe_rows.rank_rows([outcome(0, NODE0, [failed("start", "x")])])
    assert start.detail.endswith("start ✗")


def test_node_label_without_an_address():
    assert probe_rows.node_label({"node_rank": 2, "host": "h2", "address": ""}) == "node 2 (h2)"


def record(node_: dict, **facts) -> dict:
    base = {"python": "3.11", "torch": "2.14", "cuda": "13.0", "cudnn": "9", "nccl": "2.30",
            "tag": "", "gpu": "H100", "settings": {}}  # fmt: skip
    return {**node_, **base, **facts}


def test_consistency_when_every_node_agrees():
    (row,) = probe_rows.consistency_rows([record(NODE0), record(NODE1)], [NODE0, NODE1])
    assert row.name == "same on every node" and row.status == "ok"
    assert row.detail == "torch 2.14, CUDA 13.0, NCCL 2.30, Python 3.11 on 2 node(s)"


def test_consistency_on_the_cpu_says_none():
    (row,) = probe_rows.consistency_rows([record(NODE0, cuda="", nccl="")], [NODE0])
    assert "CUDA none, NCCL none" in row.detail


def test_a_different_torch_fails_and_a_different_python_warns():
    records = [record(NODE0), record(NODE1, torch="2.13", python="3.10")]
    rows = {row.name: row for row in probe_rows.consistency_rows(records, [NODE0, NODE1])}
    assert rows["mismatch: torch"].status == "fail"
    assert rows["mismatch: torch"].detail == (
        "2.14 on node 0 (h0, 10.0.0.1); 2.13 on node 1 (h1, 10.0.0.2)"
    )
    assert rows["mismatch: Python"].status == "warn"
    assert "same on every node" not in rows


def test_a_different_probe_tag_fails():
    records = [record(NODE0, tag="image-a"), record(NODE1)]
    rows = {row.name: row for row in probe_rows.consistency_rows(records, [NODE0, NODE1])}
    row = rows["mismatch: DDPCLI_PROBE_TAG"]
    assert row.status == "fail" and row.detail == (
        "image-a on node 0 (h0, 10.0.0.1); unset on node 1 (h1, 10.0.0.2)"
    )


def test_gpu_models_are_compared_per_rank():
    records = [record(NODE0, rank=0), record(NODE0, rank=1, gpu="A100")]
    rows = {row.name: row for row in probe_rows.consistency_rows(records, [NODE0])}
    assert rows["mismatch: GPU model"].status == "warn"
    assert "A100 on rank 1 on node 0 (h0, 10.0.0.1)" in rows["mismatch: GPU model"].detail


def test_different_process_counts_warn():
    other = {**NODE1, "nproc": 4}
    rows = probe_rows.consistency_rows([record(NODE0), record(other)], [NODE0, other])
    (row,) = rows
    assert row.name == "mismatch: processes per node" and row.status == "warn"
    assert row.detail == "2 on node 0 (h0, 10.0.0.1); 4 on node 1 (h1, 10.0.0.2)"


def test_settings_that_differ_warn_naming_each_value():
    records = [record(NODE0, settings={"NCCL_IB_DISABLE": "1"}), record(NODE1)]
    (row,) = probe_rows.settings_rows(records)
    assert row.name == "mismatch: NCCL_IB_DISABLE" and row.status == "warn"
    assert row.detail == "1 on node 0 (h0, 10.0.0.1); unset on node 1 (h1, 10.0.0.2)"
    assert "set NCCL_IB_DISABLE the same way on every node" in row.fix


# --- The roll call and the exchange, through an in-memory store ------------------------------


class FakeStore:
    """The TCPStore calls the roll call makes, in memory."""

    def __init__(self, data: dict[str, str] | None = None, broken: bool = False):
        self.data = {key: value.encode() for key, value in (data or {}).items()}
        self.broken = broken

    def _alive(self) -> None:
        if self.broken:
            raise RuntimeError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        self._alive()
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._alive()
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._alive()
        return all(key in self.data for key in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._alive()
        if self.data.get(key, b"") == expected.encode():
            self.data[key] = desired.encode()
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        self._alive()
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


@pytest.fixture
def instant_clock(monkeypatch):
    """The roll call's clock runs a minute per poll, so its timeouts pass at once."""
    clock = SimpleNamespace(now=0.0)

    def sleep(seconds: float) -> None:
        clock.now += 60

    monkeypatch.setattr(rollcall, "time", SimpleNamespace(monotonic=lambda: clock.now, sleep=sleep))


def test_roll_call_answer_and_wait():
    store = FakeStore({"x/1": "node-b"})
    roll = RollCall(store, "x/", 2, 0)
    assert roll.answer("node-a") == "node-a"
    assert roll.wait(1.0) == [0, 1] and roll.answers() == {0: "node-a", 1: "node-b"}


def test_roll_call_answer_returns_an_earlier_node_with_the_same_rank():
    roll = RollCall(FakeStore({"x/1": "first"}), "x/", 2, 1)
    assert roll.answer("second") == "first"


def test_roll_call_wait_returns_who_came(instant_clock):
    roll = RollCall(FakeStore({"x/0": "a"}), "x/", 3, 0)
    assert roll.wait(10.0) == [0]


def test_roll_call_verdict_ends_the_wait_of_the_others():
    store = FakeStore({"x/0": "a", "x/verdict": "only 1 of 3 nodes joined"})
    with pytest.raises(NodeZeroGaveUp, match="only 1 of 3 nodes joined"):
        RollCall(store, "x/", 3, 1).wait(10.0)
    assert store.check(["x/ack/1"])  # node 0 knows it was read


def test_roll_call_verdict_waits_for_the_reader():
    store = FakeStore({"x/ack/1": "read"})
    RollCall(store, "x/", 3, 0).post_verdict("gave up", present=[0, 1])
    assert store.get("x/verdict") == b"gave up"


def test_roll_call_on_a_real_store():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    roll = RollCall(store, "probe/node/", 2, 0)
    assert roll.answer("mine") == "mine" and roll.answer("again") == "mine"
    assert roll.answered() == [0] and roll.answers() == {0: "mine"}


def test_try_connect_and_wait_until_listening():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert rollcall.try_connect("127.0.0.1", port) == "open"
        rollcall.wait_until_listening("127.0.0.1", port, 0.0)
    assert rollcall.try_connect("127.0.0.1", port) == "refused"
    with pytest.raises(MasterUnreachable, match=r"nothing listens there \(refused\)"):
        rollcall.wait_until_listening("127.0.0.1", port, 0.0)


class OtherService:
    """A TCP service that is not a PyTorch store: it answers anything with an HTTP error."""

    def __init__(self, reply: bytes = b"HTTP/1.0 400 Bad Request\r\n\r\n") -> None:
        import threading

        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.reply = reply
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with connection:
                connection.recv(64)
                connection.sendall(self.reply)

    def __enter__(self) -> OtherService:
        return self

    def __exit__(self, *exc) -> None:
        self.listener.close()


def test_store_handshake_tells_a_pytorch_store_from_another_service():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    assert rollcall.store_handshake("127.0.0.1", store.port) is None
    store.set("still", "works")  # the handshake left the store as it was
    with OtherService() as service:
        said = rollcall.store_handshake("127.0.0.1", service.port)
        assert said == "it answered 'HTTP/1.0 400 Bad Request' to a PyTorch store's handshake"
        with pytest.raises(rollcall.NotAStore):
            rollcall.open_store("127.0.0.1", service.port, 1, 5.0)


def test_probe_names_a_non_pytorch_service_on_the_master_port():
    with OtherService() as service:
        joining = plan(master_addr="127.0.0.1", master_port=service.port, join_timeout=5.0)
        store, _, row = probe.probe_store(joining, progress=lambda line: None)
    assert store is None and row.status == "fail"
    assert f"a non-PyTorch service answers at 127.0.0.1:{service.port}" in row.detail
    assert "HTTP/1.0 400 Bad Request" in row.detail and "--master-port" in row.fix


def test_a_node_of_train_names_a_non_pytorch_service_on_the_master_port():
    with OtherService() as service:
        job = engine.WorkerJob(
            module="m", args=[], nproc_per_node=1, nnodes=2, node_rank=1,
            master_addr="127.0.0.1", master_port=service.port, timeout_s=5.0,
        )  # fmt: skip
        with pytest.raises(DdpcliError) as failed:
            engine.roll_call(job)
    assert f"node 1: a non-PyTorch service answers at 127.0.0.1:{service.port}" in str(failed.value)


def test_a_one_node_job_given_a_taken_port_is_exit_2_saying_by_what():
    with OtherService() as service, pytest.raises(DdpcliError) as failed:
        store_address.check_served_here("127.0.0.1", service.port)
    assert failed.value.exit_code == 2
    assert str(failed.value) == (
        f"cannot serve the job's store on 127.0.0.1:{service.port}: the port is in use on this "
        "machine, by a service (it answered 'HTTP/1.0 400 Bad Request' to a PyTorch store's "
        "handshake); give it a free port (--master-port or --rdzv-endpoint)"
    )


def test_a_one_node_jobs_free_port_is_left_free_for_its_store():
    from torch.distributed import TCPStore

    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    store_address.check_served_here("127.0.0.1", port)  # listens, is reached, lets go
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set("bound", "at once")


def test_a_c10d_endpoint_is_checked_before_torch_meets_it():
    from torch.distributed import TCPStore

    with OtherService() as service, pytest.raises(DdpcliError) as failed:
        store_address.check_endpoint("127.0.0.1", service.port, timeout_s=5.0)
    assert failed.value.exit_code == 1
    assert f"a non-PyTorch service answers at 127.0.0.1:{service.port}, not the c10d " \
        "rendezvous (it answered 'HTTP/1.0 400 Bad Request'" in str(failed.value)  # fmt: skip
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    store_address.check_endpoint("127.0.0.1", store.port, timeout_s=5.0)  # a store: joined
    store.set("still", "works")
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        free = probe_socket.getsockname()[1]
    store_address.check_endpoint("127.0.0.1", free, timeout_s=5.0)  # nothing yet: served here


def test_join_nodes_when_every_node_came():
    store = FakeStore({"probe/node/0": json.dumps(NODE0)})
    nodes, row = probe.join_nodes(store, plan(), NODE1)
    assert nodes == [NODE0, NODE1] and row.status == "ok"
    assert row.detail == "2 node(s) joined: node 0 (h0, 10.0.0.1) × 2, node 1 (h1, 10.0.0.2) × 2"


def test_join_nodes_with_a_node_rank_taken():
    store = FakeStore({"probe/node/1": json.dumps({**NODE1, "host": "h9"})})
    nodes, row = probe.join_nodes(store, plan(), NODE1)
    assert nodes is None and row.status == "fail"
    assert row.detail == "node rank 1 is already taken by h9 (10.0.0.2)"
    assert row.fix == "give every node its own --node-rank, 0..N-1"


def test_join_nodes_with_nodes_that_disagree_on_nnodes():
    store = FakeStore({"probe/node/0": json.dumps({**NODE0, "nnodes": 3})})
    nodes, row = probe.join_nodes(store, plan(), NODE1)
    assert nodes is None and row.detail == (
        "the nodes disagree on the world: this node says --nnodes 2, node 0 (h0, 10.0.0.1) "
        "says --nnodes 3"
    )


def test_join_nodes_names_the_node_that_never_came(instant_clock):
    nodes, row = probe.join_nodes(FakeStore(), plan(node_rank=0, join_timeout=3), NODE0)
    assert nodes is None and row.status == "fail"
    assert row.detail == (
        "the world never formed: node(s) 1 of 2 did not join within 3s; joined: "
        "node 0 (h0, 10.0.0.1)"
    )
    assert "--node-rank differing (0..1)" in row.fix


def test_join_nodes_without_node_0_suspects_another_job(instant_clock):
    nodes, row = probe.join_nodes(FakeStore(), plan(), NODE1)
    assert "node(s) 0 of 2 did not join" in row.detail and "another job?" in row.detail


def test_exchange_on_one_node_keeps_the_local_outcomes():
    local = [outcome(0, NODE0, GOOD)]
    assert probe.exchange_outcomes(FakeStore(broken=True), plan(nnodes=1), RankLayout([1]),
                                   [NODE0], local) == local  # fmt: skip


def test_exchange_merges_every_nodes_ranks_in_rank_order():
    theirs = [outcome(0, NODE0, GOOD), outcome(1, NODE0, GOOD)]
    store = FakeStore({"probe/outcome/0": json.dumps(theirs)})
    mine = [outcome(2, NODE1, GOOD), outcome(3, NODE1, GOOD)]
    merged = probe.exchange_outcomes(store, plan(), RankLayout([2, 2]), [NODE0, NODE1], mine)
    assert [o["rank"] for o in merged] == [0, 1, 2, 3]
    assert json.loads(store.get("probe/outcome/1")) == mine and store.get("probe/read") == b"1"


def test_exchange_marks_a_node_that_sent_nothing(instant_clock):
    mine = [outcome(2, NODE1, GOOD), outcome(3, NODE1, GOOD)]
    merged = probe.exchange_outcomes(FakeStore(), plan(), RankLayout([2, 2]), [NODE0, NODE1], mine)
    assert [(o["rank"], o["stages"][0]["detail"]) for o in merged[:2]] == [
        (0, "sent no report"),
        (1, "sent no report"),
    ]


def test_exchange_when_node_0s_store_is_gone():
    mine = [outcome(2, NODE1, GOOD)]
    store = FakeStore(broken=True)
    merged = probe.exchange_outcomes(store, plan(), RankLayout([1, 1]), [NODE0, NODE1], mine)
    assert merged[0]["stages"][0]["detail"] == (
        "unknown: node 0's store closed (Connection reset by peer)"
    )
    assert merged[1] == mine[0]


def test_run_probe_that_cannot_run_says_why():
    rows, document = probe.run_probe(options(backend="nccl"), node(), LOCAL_MASTER, print)
    assert [row.name for row in rows] == ["probe"]
    assert document == {"ran": False, "reason": rows[0].detail}


def test_busy_port_row_names_the_port_and_a_free_one():
    row = probe.busy_port_row(29500, RuntimeError("address already in use\nstack"))
    assert row.name == "port open" and row.status == "fail"
    assert row.detail.startswith("the store cannot listen on port 29500")
    assert row.detail.endswith(": address already in use")
    assert row.fix.startswith("pick a free port (--master-port ")


def test_node_record_names_the_gpus_only_for_nccl(monkeypatch):
    monkeypatch.setattr(probe, "address_for", lambda ifname, ip: "10.0.0.1")
    record_ = probe.node_record(node(visible_gpus=2), plan(backend="nccl", node_rank=0))
    assert (record_["gpu"], record_["address"], record_["node_rank"]) == ("H100", "10.0.0.1", 0)
    assert {"torch", "cuda", "nccl", "python", "tag", "settings"} <= set(record_)
    assert probe.node_record(node(visible_gpus=2), plan())["gpu"] == "cpu"


# --- launch's roll call: the same mechanism, its own words -----------------------------------


def job(node_rank: int, nnodes: int = 2) -> engine.WorkerJob:
    return engine.WorkerJob(module="m", args=[], nproc_per_node=2, nnodes=nnodes,
                            node_rank=node_rank, master_addr="10.0.0.1", master_port=29500,
                            timeout_s=0.05)  # fmt: skip


def test_launch_roll_call_node_0_names_the_missing_node_and_posts_why(monkeypatch):
    store = FakeStore()
    monkeypatch.setattr(engine, "open_store", lambda *args, **kwargs: store)
    with pytest.raises(DdpcliError) as caught:
        engine.roll_call(job(0, nnodes=3))
    message = caught.value.message
    assert message.startswith("only 1 of 3 nodes joined at 10.0.0.1:29500 within 0.05s")
    assert "(2 of 6 ranks); missing node rank(s): 1, 2" in message
    assert store.get("ddpcli/roll/verdict").decode() == message


def test_launch_roll_call_other_nodes_repeat_node_0s_verdict(monkeypatch):
    store = FakeStore({"ddpcli/roll/0": "h0", "ddpcli/roll/verdict": "only 2 of 3 nodes joined"})
    monkeypatch.setattr(engine, "open_store", lambda *args, **kwargs: store)
    with pytest.raises(DdpcliError) as caught:
        engine.roll_call(job(1, nnodes=3))
    assert caught.value.message == "node 1: node 0 gave up: only 2 of 3 nodes joined"


def roll_answer(host: str, **settings: str) -> str:
    return json.dumps({"host": host, "settings": settings})


def test_launch_roll_call_when_every_node_came(monkeypatch):
    store = FakeStore({"ddpcli/roll/0": roll_answer("h0")})
    monkeypatch.setattr(engine, "open_store", lambda *args, **kwargs: store)
    assert engine.roll_call(job(1)) is store
    assert json.loads(store.get("ddpcli/roll/1")) == {"host": socket.gethostname(), "settings": {}}


def test_launch_roll_call_names_the_settings_the_nodes_disagree_on(monkeypatch):
    store = FakeStore({"ddpcli/roll/0": roll_answer("h0", per_gpu_batch="16", lr="0.1")})
    monkeypatch.setattr(engine, "open_store", lambda *args, **kwargs: store)
    mine = engine.WorkerJob(**{**vars(job(1)), "settings": {"per_gpu_batch": "32", "lr": "0.1"}})
    with pytest.raises(DdpcliError) as caught:
        engine.roll_call(mine)
    assert caught.value.exit_code == 1
    here = socket.gethostname()
    assert f"  --per-gpu-batch: 16 on node 0 (h0); 32 on node 1 ({here})" in caught.value.message
    assert "--lr" not in caught.value.message
    assert store.check(["ddpcli/roll/ack/1"])  # node 0 may close the store now


def test_launch_roll_call_without_a_master(monkeypatch):
    def unreachable(*args, **kwargs):
        raise MasterUnreachable("nothing listens there (refused)")

    monkeypatch.setattr(engine, "open_store", unreachable)
    with pytest.raises(DdpcliError) as caught:
        engine.roll_call(job(1))
    assert caught.value.exit_code == 1
    assert caught.value.message.startswith(
        "node 1: could not reach the master at 10.0.0.1:29500 within 0.05s"
    )


def test_launch_roll_call_that_loses_the_master(monkeypatch):
    monkeypatch.setattr(engine, "open_store", lambda *args, **kwargs: FakeStore(broken=True))
    with pytest.raises(DdpcliError) as caught:
        engine.roll_call(job(1))
    assert caught.value.message.startswith(
        "node 1: lost the master at 10.0.0.1:29500 before all nodes joined (Connection reset"
    )
