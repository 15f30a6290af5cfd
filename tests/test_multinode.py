"""Several nodes and init methods, run for real: two `ddpcli train` in two network
namespaces joined by a veth pair (two hosts, 192.0.2.0/24), tcp:// and file:// init, a
stale init file, a node that never comes, and a node cut off mid-run.

The namespace tests need root and iproute2 and skip with the reason otherwise; the
namespaces are deleted, and every process in them killed, even when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    LiveProcess,
    clean_env,
    free_port,
    read_metrics,
    run_bounded,
    run_cli,
    traced_records,
)
from netns import Host, bridged_hosts, two_hosts

from ddpcli.config import TrainConfig
from ddpcli.launcher.train_launch import train_environment

TINY = ["--cpu", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "16"]
ONE_EPOCH = [*TINY, "--synthetic-size", "256", "--epochs", "1"]
RUN_TIMEOUT_S = 150


@contextlib.contextmanager
def nodes(commands: list[list[str]], env: dict[str, str] | None = None):
    """Start every node at once, as people do on a cluster; kill them all at the end."""
    started = [LiveProcess(command, env) for command in commands]
    try:
        yield started
    finally:
        for node in started:
            node.kill()


def kill_namespace_processes(host: Host) -> None:
    """Deleting a namespace does not stop what runs in it."""
    listed = subprocess.run(
        ["ip", "netns", "pids", host.namespace], capture_output=True, text=True, timeout=10
    )
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def hosts():
    with two_hosts() as pair:
        try:
            yield pair.hosts
        finally:
            for host in pair.hosts:
                kill_namespace_processes(host)


def node_command(host: Host, node_rank: int, master: Host, out: Path, *extra: str) -> list[str]:
    """The same command on both hosts; only --node-rank, --ifname and --out differ."""
    return host.command(
        sys.executable, "-m", "ddpcli", "train", *extra, "--nproc", "1", "--nnodes", "2",
        "--node-rank", str(node_rank), "--master-addr", master.address,
        "--ifname", host.ifname, "--out", str(out),
    )  # fmt: skip


# --- Two hosts -----------------------------------------------------------------------------


@pytest.mark.netns
@pytest.mark.parametrize("init", ["env", "tcp"])
def test_two_hosts_train_as_one_world(hosts, tmp_path, init):
    master = hosts[0]
    if init == "tcp":  # the workers meet at this port, the node agents at the next one
        extra = ["--init-method", f"tcp://{master.address}:29610"]
    else:
        extra = ["--master-port", "29600"]
    outs, trace = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "trace"
    commands = [
        node_command(host, rank, master, outs[rank], *ONE_EPOCH, "--timeout", "60", *extra)
        for rank, host in enumerate(hosts)
    ]
    # Each rank records the samples it trains on in trace.rank<global rank>.
    with nodes(commands, clean_env(DDPCLI_TRACE_SAMPLES=str(trace))) as (node0, node1):
        deadline = time.monotonic() + RUN_TIMEOUT_S
        codes = [node.finish(deadline - time.monotonic()) for node in (node0, node1)]
    assert codes == [0, 0], (node0.stderr[-2000:], node1.stderr[-2000:])
    metrics = read_metrics(outs[0])
    assert len(metrics) == 1 and metrics[0]["world_size"] == 2  # one world of 2
    assert metrics[0]["global_batch"] == 32
    assert "world size 2" in node0.stderr
    assert "node 1 finished" in node1.stderr
    config = json.loads((outs[0] / "config.json").read_text())
    assert config["ifname"] == master.ifname and config["nnodes"] == 2
    # Node 1 held global rank 1, and the two nodes trained on disjoint halves of the set.
    shards = [traced_samples(trace, rank) for rank in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 128 and not shards[0] & shards[1]


def traced_samples(trace: Path, rank: int) -> set[int]:
    return {index for record in traced_records(trace, rank) for index in record["indices"]}


@pytest.mark.netns
def test_a_store_address_on_another_host_is_one_line_within_the_timeout(hosts, tmp_path):
    """Left to torch, a one-node job given another host's address hangs (its agent serves
    the store here, its workers dial there), and a host of an elastic job whose endpoint
    is not up prints C++ stack traces; each is one line here, within --timeout."""
    here, there = hosts
    port = str(free_port())
    command = [sys.executable, "-m", "ddpcli", "train", *ONE_EPOCH, "--nproc", "1",
               "--timeout", "5", "--out", str(tmp_path / "run")]  # fmt: skip
    alone = run_bounded(
        here.command(*command, "--master-addr", there.address, "--master-port", port),
        60, clean_env(), None,
    )  # fmt: skip
    assert alone.returncode == 2, alone.stderr
    assert alone.stderr.strip().splitlines() == [
        f"error: a one-node job serves its own store, but {there.address}:{port} leads to "
        "nothing (refused), not this machine; drop that address (--master-addr or "
        "--rdzv-endpoint) or give one of this machine's, or run a multi-node job with --nnodes"
    ]
    started = time.monotonic()
    elastic = run_bounded(
        here.command(*command, "--nnodes", "1:2", "--rdzv-endpoint", f"{there.address}:{port}"),
        60, clean_env(), None,
    )  # fmt: skip
    assert elastic.returncode == 1, elastic.stderr
    assert elastic.stderr.strip().splitlines() == [
        f"error: could not reach the c10d rendezvous at {there.address}:{port} within 5s: "
        "nothing listens there (refused); start the same command on the endpoint's host, "
        f"which serves it, and check the address and that the port is open (ddpcli check-env "
        f"--master-addr {there.address} --master-port {port})"
    ]
    assert time.monotonic() - started < 30
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.netns
def test_node_cut_off_mid_run_ends_both_within_the_timeout(hosts, tmp_path):
    """Node 1's link goes down mid-epoch: no connection is closed, so nothing but
    --timeout can end the collective both ranks are in. Both nodes exit 1, in bounded time."""
    master, worker = hosts
    settings = [*TINY, "--synthetic-size", "8192", "--epochs", "1", "--log-every", "1"]
    commands = [
        node_command(host, rank, master, tmp_path / f"node{rank}", *settings, "--timeout", "15")
        for rank, host in enumerate(hosts)
    ]
    with nodes(commands) as (node0, node1):
        node0.wait_for("step 2/", timeout=RUN_TIMEOUT_S)
        subprocess.run(
            ["ip", "-n", worker.namespace, "link", "set", worker.ifname, "down"],
            check=True, timeout=10,
        )  # fmt: skip
        cut_at = time.monotonic()
        codes = [node.finish(cut_at + 60 - time.monotonic()) for node in (node0, node1)]
        ended_after = time.monotonic() - cut_at
    assert codes == [1, 1], (node0.stderr[-2000:], node1.stderr[-2000:])
    assert ended_after < 15 + 30  # --timeout, plus the agents' own shutdown
    for node in (node0, node1):
        assert "did not finish within --timeout" in node.stderr, node.stderr[-2000:]
        assert "Traceback" not in node.stderr


# --- Init methods --------------------------------------------------------------------------


def test_file_init_trains_and_removes_the_file(tmp_path):
    init_file, out = tmp_path / "init", tmp_path / "run"
    result = run_cli(
        "train", *ONE_EPOCH, "--nproc", "2", "--init-method", f"file://{init_file}",
        "--timeout", "60", "--out", str(out), timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_metrics(out)[0]["world_size"] == 2
    assert not init_file.exists()  # a clean run leaves nothing for the next one to trip on


def test_stale_init_file_is_refused(tmp_path):
    init_file = tmp_path / "init"
    init_file.write_bytes(b"left by an earlier run")
    result = run_cli(
        "train", *ONE_EPOCH, "--nproc", "2", "--init-method", f"file://{init_file}",
        "--out", str(tmp_path / "run"), timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"{init_file} already exists" in result.stderr
    assert f"rm {init_file}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tcp_init_on_several_nodes_derives_the_agents_address(in_process):
    result = in_process(
        "train", "--cpu", "--nnodes", "2", "--node-rank", "1",
        "--init-method", "tcp://10.0.0.1:23456", "--dry-run", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert (config["master_addr"], config["master_port"]) == ("10.0.0.1", 23457)
    clash = in_process(
        "train", "--cpu", "--init-method", "tcp://127.0.0.1:23456", "--master-port", "23456",
        "--dry-run",
    )  # fmt: skip
    assert clash.returncode == 2 and "--master-port" in clash.stderr


def test_ifname_sets_both_socket_variables():
    env = train_environment(TrainConfig(cpu=True, nproc=1, ifname="eth1"))
    assert env["GLOO_SOCKET_IFNAME"] == "eth1" and env["NCCL_SOCKET_IFNAME"] == "eth1"


# --- A node that never comes ---------------------------------------------------------------


def test_missing_node_times_out_naming_it(tmp_path):
    """Three nodes expected, two come: after --timeout node 0 names the missing one, and
    node 1 repeats it. A node 1 whose master never comes says so. All exit 1."""
    port, lonely_port = free_port(), free_port()
    base = [
        sys.executable, "-m", "ddpcli", "train", *ONE_EPOCH, "--nproc", "1",
        "--master-addr", "127.0.0.1", "--timeout", "10",
    ]  # fmt: skip
    three = [*base, "--nnodes", "3", "--master-port", str(port)]
    commands = [
        [*three, "--node-rank", "0", "--out", str(tmp_path / "n0")],
        [*three, "--node-rank", "1", "--out", str(tmp_path / "n1")],
        [*base, "--nnodes", "2", "--node-rank", "1", "--master-port", str(lonely_port),
         "--out", str(tmp_path / "lonely")],
    ]  # fmt: skip
    started = time.monotonic()
    with nodes(commands) as (node0, node1, lonely):
        deadline = started + 90
        codes = [node.finish(deadline - time.monotonic()) for node in (node0, node1, lonely)]
    assert codes == [1, 1, 1], (node0.stderr, node1.stderr, lonely.stderr)
    assert time.monotonic() - started < 60
    assert "only 2 of 3 nodes joined" in node0.stderr, node0.stderr
    assert "(2 of 3 ranks); missing node rank(s): 2" in node0.stderr
    assert "node 1: node 0 gave up: only 2 of 3 nodes joined" in node1.stderr, node1.stderr
    assert "could not reach the master at 127.0.0.1" in lonely.stderr, lonely.stderr
    for node in (node0, node1, lonely):
        assert "Traceback" not in node.stderr


# --- Nodes started with different settings -------------------------------------------------


def test_nodes_with_different_settings_stop_at_once_naming_them(tmp_path):
    """Two nodes on one machine, one with --per-gpu-batch 16 and one with 32: both exit 1
    long before --timeout, each naming the setting and every node's value."""
    port = free_port()
    base = [
        sys.executable, "-m", "ddpcli", "train", *ONE_EPOCH, "--nproc", "1", "--nnodes", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "120",
    ]  # fmt: skip
    commands = [
        [*base, "--node-rank", "0", "--out", str(tmp_path / "n0")],  # ONE_EPOCH's batch: 16
        [*base, "--node-rank", "1", "--per-gpu-batch", "32", "--out", str(tmp_path / "n1")],
    ]
    started = time.monotonic()
    with nodes(commands) as (node0, node1):
        deadline = started + 90
        codes = [node.finish(deadline - time.monotonic()) for node in (node0, node1)]
    assert codes == [1, 1], (node0.stderr, node1.stderr)
    assert time.monotonic() - started < 60  # not the --timeout of 120
    for node in (node0, node1):
        assert "the nodes were started with different settings" in node.stderr, node.stderr
        assert "--per-gpu-batch: 16 on node 0 (" in node.stderr
        assert "; 32 on node 1 (" in node.stderr
        assert "Traceback" not in node.stderr
    assert not (tmp_path / "n0" / "metrics.jsonl").exists()


def test_only_the_per_node_settings_may_differ():
    from ddpcli.launcher.rollcall import disagreements
    from ddpcli.launcher.train_launch import settings_every_node_shares

    node0 = TrainConfig(cpu=True, nnodes=2, node_rank=0, out=Path("/a"), timeout=30, lr=0.1)
    node1 = TrainConfig(
        cpu=True, nnodes=2, node_rank=1, out=Path("/b"), ifname="eth1", lr=0.2, nproc=4
    )
    found = disagreements(
        {"node 0": settings_every_node_shares(node0), "node 1": settings_every_node_shares(node1)}
    )
    assert found == {
        "lr": {"0.1": ["node 0"], "0.2": ["node 1"]},
        "nproc": {"unset": ["node 0"], "4": ["node 1"]},
        "nproc_per_node": {"2": ["node 0"], "4": ["node 1"]},
    }


# --- One run folder, several nodes ---------------------------------------------------------


def test_two_nodes_sharing_out_write_one_run(tmp_path):
    """Two nodes of one job on one machine pass the same --out (a shared file system): the
    folder admits both, they finish, and rank 0's run is the one there."""
    port, out = free_port(), tmp_path / "shared"
    base = [
        sys.executable, "-m", "ddpcli", "train", *ONE_EPOCH, "--nproc", "1", "--nnodes", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "60",
        "--out", str(out),
    ]  # fmt: skip
    commands = [[*base, "--node-rank", str(rank)] for rank in (1, 0)]  # node 1 locks first
    with nodes(commands) as (node1, node0):
        deadline = time.monotonic() + RUN_TIMEOUT_S
        codes = [node.finish(deadline - time.monotonic()) for node in (node0, node1)]
    assert codes == [0, 0], (node0.stderr[-2000:], node1.stderr[-2000:])
    metrics = read_metrics(out)
    assert len(metrics) == 1 and metrics[0]["world_size"] == 2
    assert json.loads((out / "config.json").read_text())["nnodes"] == 2
    assert "node 1 finished" in node1.stderr


# --- Elastic membership: --nnodes MIN:MAX ----------------------------------------------------


@pytest.fixture
def three_hosts():
    with bridged_hosts(3) as hosts:
        try:
            yield hosts
        finally:
            for host in hosts:
                kill_namespace_processes(host)


def any_says(processes: list[LiveProcess], text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in process.stderr for process in processes):
        if time.monotonic() > deadline:
            logs = "\n---\n".join(process.stderr[-1500:] for process in processes)
            raise AssertionError(f"no {text!r} within {timeout}s:\n{logs}")
        time.sleep(0.1)


@pytest.mark.netns
def test_a_lost_host_leaves_a_smaller_world_that_finishes(three_hosts, tmp_path):
    """Three hosts behind a bridge run the same command, `--nnodes 2:3`, with no node rank
    and no address but the endpoint's; one is SIGKILLed in epoch 2; the other two restart
    from the last checkpoint as a world of 2 and finish; the shared --out holds one run."""
    out, endpoint = tmp_path / "shared", f"{three_hosts[0].address}:29400"
    settings = [*TINY, "--synthetic-size", "384", "--epochs", "3", "--log-every", "1"]
    commands = [
        host.command(
            sys.executable,
            "-m",
            "ddpcli",
            "train",
            *settings,
            "--nproc",
            "1",
            "--nnodes",
            "2:3",
            "--rdzv-endpoint",
            endpoint,
            "--max-restarts",
            "2",
            "--ifname",
            host.ifname,
            "--timeout",
            "30",
            "--out",
            str(out),
        )  # fmt: skip
        for host in three_hosts
    ]
    with nodes(commands) as started:
        any_says(started, "epoch 2/3 step 1/", timeout=RUN_TIMEOUT_S)
        kill_namespace_processes(three_hosts[2])
        deadline = time.monotonic() + RUN_TIMEOUT_S
        codes = [node.finish(deadline - time.monotonic()) for node in started[:2]]
    logs = "\n---\n".join(node.stderr[-2000:] for node in started)
    assert codes == [0, 0], logs
    worlds = [epoch["world_size"] for epoch in read_metrics(out)]
    assert worlds == [3, 2, 2], logs
    said = started[0].stderr + started[1].stderr
    assert "world 3 -> 2: global batch 48 -> 32 (per-process batch" in said, logs
    assert "Traceback" not in said


def test_a_host_that_joins_a_running_job_is_admitted_and_the_run_goes_on(tmp_path):
    """`--nnodes 1:2` on one machine: the first host trains alone; a second host joins in
    epoch 1. The first host's worker stops at an agreed step and saves; both start the next
    round as a world of 2, which continues from that checkpoint. Before, the new host waited
    for good for an address the first one published in its first round only, and the
    restarted workers would have started the run over. Rank 0 waits a second for each batch
    (a sleep, not work): the first host's epoch 1 alone lasts 48 s, time enough for the
    second to start and join inside it on a busy machine, for little CPU."""
    out, endpoint = tmp_path / "shared", f"127.0.0.1:{free_port()}"
    command = [
        sys.executable, "-m", "ddpcli", "train", *TINY, "--synthetic-size", "768",
        "--epochs", "2", "--log-every", "4", "--nproc", "1", "--nnodes", "1:2",
        "--rdzv-endpoint", endpoint, "--timeout", "60", "--out", str(out),
    ]  # fmt: skip
    env = clean_env(DDPCLI_SLOW_DATA="0:1")
    first = LiveProcess(command, env)
    try:
        first.wait_for("epoch 1/2 step", timeout=RUN_TIMEOUT_S)
        with nodes([command], env) as (second,):
            deadline = time.monotonic() + RUN_TIMEOUT_S
            codes = [node.finish(deadline - time.monotonic()) for node in (first, second)]
    finally:
        first.kill()
    logs = f"{first.stderr[-2500:]}\n---\n{second.stderr[-1500:]}"
    assert codes == [0, 0], logs
    assert "a new round of the job: resuming from the last checkpoint" in first.stderr, logs
    assert "world 1 -> 2: global batch 16 -> 32" in first.stderr, logs
    assert "trained before the resume" in first.stderr, logs  # continued, not started over
    assert [epoch["world_size"] for epoch in read_metrics(out)] == [2, 2], logs
