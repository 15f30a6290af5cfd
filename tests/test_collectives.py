"""When ranks stop agreeing (issue 49): every rank runs with torch's flight recorder, the
live ranks dump their records when one fails, the launcher keeps them in the run's
collectives/ folder (named by host and rank, as torch's analyzer reads them) and says in a
few lines which rank ran which collective, from which line of the user's code, and why.
Three Gloo ranks; each model turns faulty on rank 1 (or 2) after its first steps
(tests/fixtures/faults/faulty.py)."""

from __future__ import annotations

import json
import pickle
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ANALYZER_READS_GLOO, REPO, clean_env, run_cli

FAULTS = REPO / "tests" / "fixtures" / "faults" / "faulty.py"
RUN = [
    "--cpu", "--nproc", "3", "--image-size", "16", "--per-gpu-batch", "4",
    "--synthetic-size", "96", "--epochs", "1", "--timeout", "30", "--workers", "0",
]  # fmt: skip


def marked_line(marker: str) -> int:
    """The line of faulty.py with `# marker: MARKER`."""
    lines = FAULTS.read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if f"# marker: {marker}" in line)


def failed_run(tmp_path: Path, factory: str, *extra: str):
    out = tmp_path / "run"
    result = run_cli(
        "train", *RUN, "--arch", f"{FAULTS}:{factory}", "--out", str(out), *extra, timeout=120
    )
    assert result.returncode == 1, result.stderr[-3000:]
    return out, result.stderr


def verdict_lines(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if line.startswith("error:"))


def test_an_extra_all_reduce_on_one_rank_is_named_with_its_line(tmp_path):
    out, stderr = failed_run(tmp_path, "extra")
    said = verdict_lines(stderr)
    line = marked_line("extra")
    assert re.search(
        rf"rank 1 ran all_reduce float32\[3\] at \S*faulty\.py:{line} in forward\(\).*\(#\d+\), "
        r"where ranks 0 and 2 ran DDP's gradient all_reduce",
        said,
    ), said
    assert "a collective that only some ranks run" in said
    kept = sorted(path.name for path in (out / "collectives").iterdir())
    host = socket.gethostname()
    assert kept == [f"{host}.rank_0", f"{host}.rank_1", f"{host}.rank_2"], kept
    record = pickle.loads((out / "collectives" / f"{host}.rank_1").read_bytes())
    assert record["entries"] and record["ddpcli"]["rank"] == 1


@pytest.fixture(scope="module")
def size_run(tmp_path_factory):
    """Rank 2's all_reduce has 4 elements where the others' have 3: Gloo waits for the
    missing bytes until --timeout (the shortest that still lets the job form)."""
    return failed_run(tmp_path_factory.mktemp("size"), "size", "--timeout", "10")


@ANALYZER_READS_GLOO
def test_the_kept_records_open_in_torchs_analyzer(size_run):
    from torch.distributed.flight_recorder import fr_trace

    out, _ = size_run
    fr_trace.main([str(out / "collectives"), "--prefix", "rank_"])  # raises if it cannot


def test_a_collective_of_another_size_on_one_rank(size_run):
    _, stderr = size_run
    said = verdict_lines(stderr)
    line = marked_line("size")
    assert re.search(
        rf"rank 2 ran all_reduce float32\[4\] at \S*faulty\.py:{line} in forward\(\)", said
    ), said
    assert "the same collective with different sizes" in said


@pytest.mark.parametrize("recorder", ["--flight-recorder", "--no-flight-recorder"])
def test_a_parameter_unused_on_one_rank_says_find_unused_parameters(tmp_path, recorder):
    out, stderr = failed_run(tmp_path, "unused", recorder)
    said = verdict_lines(stderr)
    assert "--find-unused-parameters" in said
    if recorder == "--no-flight-recorder":
        assert not (out / "collectives").exists()
        assert "never issued" not in said
    else:
        assert re.search(r"rank 1 never issued #\d+", said), said
        summary = json.loads((out / "summary.json").read_text())  # the agreed stop's, too
        assert summary["verdict"]["cause"] == "unused_parameters" and summary["exit_code"] == 1


def test_a_rank_that_never_reaches_the_collective_is_in_the_json_and_the_summary(tmp_path):
    """Rank 2 waits a minute for each batch; ranks 0 and 1 give up at the collective after
    --timeout. The report names rank 2 and where it was; the verdict, as data on stdout and
    in summary.json, says the collective the others waited in, which it never issued."""
    out = tmp_path / "run"
    args = [*RUN[:-4], "--workers", "0", "--timeout", "5", "--arch", "tinycnn"]
    result = run_cli(
        "train", *args, "--out", str(out), "--json", env={"DDPCLI_SLOW_DATA": "2:60"},
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    said = verdict_lines(result.stderr)
    assert f"rank 2 on {socket.gethostname()} stopped responding" in said, said
    assert "ddpcli/data/pipeline.py" in said
    assert re.search(r"ranks 0 and 1 waited in .* \(#\d+\), which rank 2 never issued", said), said
    document = json.loads(result.stdout)
    verdict = document["verdict"]
    assert verdict["cause"] == "never_reached" and verdict["odd"] == [2], verdict
    assert verdict["behind"] == [2] and verdict["ranks"]["2"]["state"] == "behind"
    assert verdict["sequence"] == verdict["last_agreed"] + 1
    assert verdict["progress"] == {"epoch": 1, "step": 1}  # rank 2 never had its first batch
    assert json.loads((out / "summary.json").read_text())["verdict"] == verdict


def test_a_killed_rank_keeps_its_line_and_the_verdict_adds_what_it_died_after(tmp_path):
    from test_faults import Background

    out = tmp_path / "run"
    args = [*RUN[:-4], "--workers", "0", "--arch", "tinycnn", "--synthetic-size", "4800"]
    env = clean_env(DDPCLI_SLOW_DATA="2:0.2")  # the run stays mid-epoch while it is killed
    with Background("train", *args, "--log-every", "1", "--out", str(out), env=env) as run:
        run.wait_for("epoch 1/1 step 2/")
        run.kill_worker(2)
        code = run.finish(timeout=60)
    said = verdict_lines(run.stderr)
    assert code == 1, run.stderr[-3000:]
    assert f"rank 2 on {socket.gethostname()} failed first: killed by SIGKILL" in said, said
    # Ranks 0 and 1 (or the one of them that had its batch) waited in a collective for it.
    match = re.search(r"waited in .* \(#(\d+)\) for rank 2; it completed #(\d+)", said)
    assert match and int(match[2]) == int(match[1]) - 1, said
    kept = sorted(path.name.split(".")[-1] for path in (out / "collectives").iterdir())
    assert kept == ["rank_0", "rank_1"], kept  # a killed rank leaves no record


@pytest.mark.parametrize("recorder", ["--flight-recorder", "--no-flight-recorder"])
def test_a_plain_scripts_extra_collective_under_launch(tmp_path, recorder):
    script = REPO / "tests" / "fixtures" / "faults" / "extra_collective.py"
    logs = tmp_path / "logs"
    args = ["--nproc", "3", "--log-dir", str(logs), recorder, str(script)]
    result = run_cli("launch", *args, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    said = verdict_lines(result.stderr)
    if recorder == "--no-flight-recorder":  # today's report: the rank Gloo aborted
        assert f"rank 1 on {socket.gethostname()} failed first: killed by SIGABRT" in said
        assert "ran all_reduce" not in said and not (logs / "collectives").exists()
        return
    extra, every = (
        next(n for n, line in enumerate(script.read_text().splitlines(), 1) if marker in line)
        for marker in ("# marker: extra", "# marker: every rank")
    )
    assert re.search(
        rf"rank 1 ran all_reduce float32\[3\] at \S*extra_collective\.py:{extra} in <module>\(\) "
        rf"\(#(\d+)\), where ranks 0 and 2 ran all_reduce float32\[256\] at "
        rf"\S*extra_collective\.py:{every} in <module>\(\) \(#\1\)",
        said,
    ), said
    assert len(list((logs / "collectives").iterdir())) == 3


def test_a_plain_scripts_record_has_its_lines_without_importing_inductor(tmp_path):
    """torch asks torch._inductor of each frame it records; a script that never imported it
    gets its record in milliseconds, its lines in it, and torch as it was."""
    script = tmp_path / "one_rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, pickle, sys, time
        from pathlib import Path
        os.environ.update(TORCH_FR_BUFFER_SIZE="100", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        import torch, torch.distributed as dist
        from ddpcli.collectives.record import dump_record
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.all_reduce(torch.ones(3))  # the line
        started = time.monotonic()
        assert dump_record(Path({str(tmp_path)!r}), 0)
        took = time.monotonic() - started
        print(took, "torch._inductor" in sys.modules, "_inductor" in vars(torch))
        """)
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60,
        env=clean_env(), cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    took, imported, attribute = done.stdout.split()
    assert float(took) < 1.0 and imported == attribute == "False", done.stdout
    record = pickle.loads((tmp_path / "rank_0").read_bytes())
    lines = script.read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if "the line" in text)
    frames = record["entries"][0]["frames"]
    assert any(f["filename"] == str(script) and f["line"] == line for f in frames), frames


def test_a_node_that_cannot_send_its_records_to_node_0_says_so(tmp_path):
    import datetime

    import torch.distributed as dist

    from ddpcli.errors import DdpcliError
    from ddpcli.launcher.engine import WorkerJob, with_records_sent

    record = tmp_path / "vm.rank_1"
    record.write_bytes(pickle.dumps({"entries": [], "ddpcli": {"host": "vm", "rank": 1}}))
    node0 = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.TCPStore(
        "127.0.0.1", node0.port, is_master=False, timeout=datetime.timedelta(seconds=5)
    )
    job = WorkerJob(module="m", args=[], nproc_per_node=1, nnodes=2, node_rank=1)
    described = DdpcliError("rank 1 on vm failed first", 1)
    assert with_records_sent(described, job, store, [record]) is described
    assert node0.get("ddpcli/records/1") == record.read_bytes()
    del node0  # node 0 has ended
    said = with_records_sent(described, job, store, [record])
    assert said.exit_code == 1 and said.message.startswith("rank 1 on vm failed first\n")
    assert "node 1: could not send its ranks' flight records to node 0" in said.message
    assert str(tmp_path) in said.message


def test_records_the_analyzer_cannot_read_cost_the_verdict_not_the_report(tmp_path):
    """torch's analyzer refuses what it has no name for (torch 2.11's took no Gloo record at
    all): the failure is then reported as it was, with a line on the records, never the
    analyzer's AssertionError in its place."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpcli.errors import DdpcliError
    from ddpcli.launcher.engine import WorkerJob, with_verdict

    records = tmp_path / "records"
    records.mkdir()
    for rank in range(3):
        dump = pickle.loads(
            (REPO / "tests/fixtures/collectives/extra_collective" / f"rank_{rank}").read_bytes()
        )
        for entry in dump["entries"]:
            entry["profiling_name"] = "gloo:frobnicate"
        (records / f"rank_{rank}").write_bytes(pickle.dumps(dump))
    kept = tmp_path / "run" / "collectives"
    job = WorkerJob(module="m", args=[], nproc_per_node=3, records_kept_in=kept)
    killed = ProcessFailure(1, 1001, -9, str(tmp_path / "no-error-file.json"))
    described = DdpcliError("rank 1 on vm failed first: killed by SIGKILL", 1)
    said = with_verdict(described, job, ChildFailedError("worker", {1: killed}), records, None)
    assert said.exit_code == 1
    assert said.message.startswith(described.message + "\n  no verdict on the ranks' collectives")
    assert str(kept) in said.message and "frobnicate is not a supported operation" in said.message


@pytest.mark.netns
@pytest.mark.parametrize("outs", ["shared", "own"])
def test_node_0_judges_from_the_records_of_another_node(tmp_path, outs):
    """Two hosts (network namespaces), one rank each; one --out on the file system they
    share, or one each. Rank 1, on the second host, runs the extra all_reduce; node 0 finds
    its record (left in the shared OUT/collectives, or posted on the nodes' store) and names
    it, with its line."""
    from netns import two_hosts
    from test_multinode import kill_namespace_processes, node_command, nodes

    node_outs = (
        [tmp_path / "run"] * 2 if outs == "shared" else [tmp_path / "run0", tmp_path / "run1"]
    )
    settings = [
        "--cpu", *RUN[3:], "--arch", f"{FAULTS}:extra", "--model-arg", "odd_rank=1",
        "--master-port", "29640",
    ]  # fmt: skip
    with two_hosts() as pair:
        try:
            master = pair.hosts[0]
            commands = [
                node_command(host, rank, master, node_outs[rank], *settings)
                for rank, host in enumerate(pair.hosts)
            ]
            with nodes(commands, clean_env()) as (node0, node1):
                codes = [node.finish(timeout=150) for node in (node0, node1)]
        finally:
            for host in pair.hosts:
                kill_namespace_processes(host)
    assert codes == [1, 1], (node0.stderr[-2000:], node1.stderr[-2000:])
    said = verdict_lines(node0.stderr)
    assert re.search(
        rf"rank 1 ran all_reduce float32\[3\] at \S*faulty\.py:{marked_line('extra')} in "
        r"forward\(\) \(#\d+\), where rank 0 ran DDP's gradient all_reduce",
        said,
    ), said
    kept = sorted(path.name for path in (node_outs[0] / "collectives").iterdir())
    assert kept == [f"{socket.gethostname()}.rank_{rank}" for rank in (0, 1)], kept
    assert "could not send" not in node1.stderr, node1.stderr[-2000:]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_on_nccl_an_extra_all_reduce_hangs_until_the_timeout_then_is_named(tmp_path):
    """NCCL does not abort on a mismatched collective: the ranks hang until --timeout, when
    its watchdog ends them; the records tell the same verdict as on Gloo, within the timeout
    and a bounded margin."""
    import time

    out = tmp_path / "run"
    args = [
        "--gpus", "0,1", "--image-size", "16", "--per-gpu-batch", "4", "--synthetic-size", "96",
        "--epochs", "1", "--timeout", "20", "--workers", "0", "--arch", f"{FAULTS}:extra",
    ]  # fmt: skip
    started = time.monotonic()
    result = run_cli("train", *args, "--out", str(out), timeout=240)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    said = verdict_lines(result.stderr)
    assert re.search(
        rf"rank 1 ran all_reduce float32\[3\] at \S*faulty\.py:{marked_line('extra')} in "
        r"forward\(\) \(#\d+\), where rank 0 ran DDP's gradient all_reduce",
        said,
    ), said
    assert took < 20 + 90, f"{took:.0f} s"  # start-up, the timeout, the records' wait
