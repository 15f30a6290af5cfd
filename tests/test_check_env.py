"""`ddpcli check-env`: the report, bad input, a busy port, and real probes (two Gloo
processes here; two nodes in two network namespaces)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import REPO, free_port, popen, run_cli
from netns import two_hosts

PROBE_TIMEOUT_S = 120


def report(result: subprocess.CompletedProcess) -> dict:
    """The JSON document; --json must leave nothing else on stdout."""
    return json.loads(result.stdout)


def rows(document: dict, section: str | None = None) -> dict[str, dict]:
    return {
        row["name"]: row
        for row in document["checks"]
        if section is None or row["section"] == section
    }


def failed(document: dict) -> dict[str, dict]:
    return {name: row for name, row in rows(document).items() if row["status"] == "fail"}


def test_help_does_not_import_torch():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpcli", "check-env", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0
    assert "--probe" in result.stdout
    assert not [line for line in result.stderr.splitlines() if line.rstrip().endswith("| torch")]


@pytest.fixture
def check_env(in_process, monkeypatch):
    """`ddpcli check-env ARGS` in this process, with what the command sets for itself
    (TORCH_CPP_LOG_LEVEL) undone afterwards: no interpreter and no torch import of its own.
    A --probe's ranks are still processes of their own, each in its own session, which
    the probe stops by its deadlines; a test that probes keeps run_cli's bound on the whole
    (pytest-timeout's mark)."""
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "placeholder")  # restored as it was, after
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL")
    return lambda *args: in_process("check-env", *args)


def test_report_on_this_machine_with_loopback(check_env):
    port = str(free_port())
    result = check_env("--ifname", "lo", "--master-port", port, "--json")
    document = report(result)
    assert result.returncode == 0, failed(document)
    assert document["ok"] and document["exit_code"] == 0
    found = rows(document)
    for name in ("Python", "torch", "CUDA", "NCCL", "Gloo backend", "CUDA_VISIBLE_DEVICES"):
        assert found[name]["status"] in ("ok", "warn"), found[name]
    assert "interface lo" in found
    assert "GLOO_SOCKET_IFNAME=lo" in found["--ifname lo"]["detail"]
    assert found[f"master port {port}"]["status"] == "ok"
    assert any(iface["name"] == "lo" and iface["up"] for iface in document["interfaces"])


def test_a_tmpdir_too_long_for_multiprocessings_sockets_is_a_warning(
    tmp_path, check_env, monkeypatch
):
    long = tmp_path / ("job-folder-" + "x" * 80)
    long.mkdir()

    def with_tmpdir(folder: str) -> dict:
        """As a process started with TMPDIR=FOLDER sees it: tempfile reads it afresh."""
        monkeypatch.setenv("TMPDIR", folder)
        monkeypatch.setattr(tempfile, "tempdir", None)
        return report(check_env("--json"))

    document = with_tmpdir(str(long))
    row = rows(document, "environment")["TMPDIR"]
    assert row["status"] == "warn" and "DataLoader workers" in row["detail"], row
    assert "export TMPDIR=/tmp" in row["fix"]
    short = with_tmpdir("/tmp")
    assert rows(short)["TMPDIR"]["status"] == "ok"


def test_human_report_is_a_table_on_stderr(check_env):
    result = check_env("--master-port", str(free_port()))
    assert result.returncode in (0, 1)  # this machine's state is not the test's business
    assert result.stdout == ""
    assert "interface lo" in result.stderr and "check-env:" in result.stderr


def test_missing_interface_is_bad_input(check_env):
    result = check_env("--ifname", "nosuch0")
    assert result.returncode == 2
    assert "nosuch0" in result.stderr and "lo" in result.stderr  # lists what exists
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ("--nnodes", "2", "--node-rank", "2", "--master-addr", "192.0.2.1"),
        ("--nnodes", "2", "--node-rank", "1"),  # several nodes need a reachable master
        ("--master-port", "70000"),
        ("--backend", "mpi-please"),
    ],
)
def test_bad_flags_exit_2(check_env, flags):
    result = check_env(*flags)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("visible", "inside", "lost"),
    [
        (None, {0: 0, 1: 1, 2: 2, 3: 3}, []),
        ("0,3", {0: 0, 3: 1}, []),  # physical GPU 3 is cuda:1 inside the process
        ("GPU-ccc,0", {2: 0, 0: 1}, []),  # UUID prefixes work too
        ("1,7,2", {1: 0}, ["7", "2"]),  # CUDA drops a bad entry and everything after it
        ("", {}, []),
    ],
)
def test_cuda_visible_devices_mapping(visible, inside, lost):
    """The renumbering every GPU row reports; pure logic, so it is checked without a GPU."""
    from ddpcli.checkenv.facts import Gpu, map_visible_devices

    gpus = [Gpu(index, "GPU", 81559, f"GPU-{letter * 3}") for index, letter in enumerate("abcd")]
    assert map_visible_devices(gpus, visible) == lost
    assert {gpu.index: gpu.cuda_index for gpu in gpus if gpu.cuda_index is not None} == inside


def test_busy_port_is_a_failed_row_naming_the_port(check_env):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = check_env("--master-port", str(port), "--json")
    document = report(result)
    assert result.returncode == 1
    row = failed(document)[f"master port {port}"]
    assert str(port) in row["detail"] and "--master-port" in row["fix"]
    if shutil.which("ss"):  # the system tells who holds it: this test's own process
        assert f"pid {os.getpid()}" in row["detail"]


@pytest.mark.timeout(PROBE_TIMEOUT_S)
def test_probe_with_two_gloo_processes(check_env):
    result = check_env("--probe", "--nproc", "2", "--backend", "gloo", "--json")
    document = report(result)
    assert result.returncode == 0, (failed(document), result.stderr[-2000:])
    probe = document["probe"]
    assert probe["ran"] and probe["world_size"] == 2 and probe["backend"] == "gloo"
    found = rows(document, "probe")
    for name in ("port open", "store rendezvous", "process group", "all_reduce result",
                 "barrier latency", "all_reduce bandwidth", "rank 0", "rank 1"):  # fmt: skip
        assert found[name]["status"] == "ok", found[name]
    for rank in probe["ranks"]:
        assert [stage["stage"] for stage in rank["stages"] if stage["ok"]] == [
            "start", "init", "all_reduce", "facts", "barrier", "bandwidth",
        ]  # fmt: skip
    assert "GB/s" in found["all_reduce bandwidth"]["detail"]
    assert len(probe["facts"]) == 2


@pytest.mark.timeout(PROBE_TIMEOUT_S)
def test_probe_of_one_process_forms_a_group_and_passes(check_env):
    """One process (a one-GPU node's default) is still a group: all_reduce and barrier run."""
    result = check_env("--probe", "--nproc", "1", "--backend", "gloo", "--json")
    document = report(result)
    found = rows(document, "probe")
    assert not failed(document), (failed(document), result.stderr[-2000:])
    assert result.returncode == 0
    assert document["probe"]["world_size"] == 1
    for name in ("process group", "all_reduce result", "barrier latency", "rank 0"):
        assert found[name]["status"] == "ok", found[name]


@pytest.mark.gpu
def test_probe_of_one_gpu_forms_an_nccl_group_and_passes():
    """A one-GPU node's default world: one NCCL rank, a real group, its collectives checked."""
    result = run_cli(
        "check-env", "--probe", "--nproc", "1", "--backend", "nccl", "--json",
        timeout=PROBE_TIMEOUT_S,
    )  # fmt: skip
    document = report(result)
    found = rows(document, "probe")
    assert document["probe"]["world_size"] == 1 and document["probe"]["backend"] == "nccl"
    for name in ("process group", "all_reduce result", "barrier latency", "rank 0"):
        assert found[name]["status"] == "ok", (found[name], result.stderr[-2000:])


def node_command(host, node_rank: int, master, ifname: str, *extra: str) -> list[str]:
    return host.command(
        sys.executable, "-m", "ddpcli", "check-env", "--probe", "--json",
        "--nnodes", "2", "--node-rank", str(node_rank), "--nproc", "1",
        "--master-addr", master.address, "--master-port", "29500", "--ifname", ifname, *extra,
    )  # fmt: skip


def run_nodes(commands: list[tuple[list[str], dict]]) -> list[subprocess.CompletedProcess]:
    """Start every node at once, as a person does on a cluster; wait with a timeout."""
    started = [
        (command, popen(command, {**os.environ, "PYTHONUNBUFFERED": "1", **env}))
        for command, env in commands
    ]
    results = []
    try:
        for command, process in started:
            out, err = process.communicate(timeout=PROBE_TIMEOUT_S)
            results.append(subprocess.CompletedProcess(command, process.returncode, out, err))
    finally:
        for _, process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


@pytest.mark.netns
def test_two_node_probe_flags_a_setting_that_differs():
    with two_hosts() as pair:
        node0, node1 = pair.hosts
        results = run_nodes(
            [
                (node_command(node0, 0, node0, node0.ifname), {"DDPCLI_PROBE_TAG": "image-a"}),
                (
                    node_command(node1, 1, node0, node1.ifname),
                    {"DDPCLI_PROBE_TAG": "image-b", "NCCL_IB_DISABLE": "1"},
                ),
            ]
        )
    for result in results:
        document = report(result)
        found = rows(document, "probe")
        # The collective itself works across the veth pair...
        for name in ("store rendezvous", "process group", "all_reduce result", "rank facts"):
            assert found[name]["status"] == "ok", (name, found[name], result.stderr[-1500:])
        assert {fact["address"] for fact in document["probe"]["facts"]} == {
            node0.address,
            node1.address,
        }
        # ...and every node names the settings that differ between them.
        tag = found["mismatch: DDPCLI_PROBE_TAG"]
        assert tag["status"] == "fail"
        assert "image-a" in tag["detail"] and "image-b" in tag["detail"]
        assert node1.address in tag["detail"]
        assert found["mismatch: NCCL_IB_DISABLE"]["status"] == "warn"
        assert "mismatch: torch" not in found
        assert result.returncode == 1  # a failed row gates the job script


@pytest.mark.netns
def test_probe_names_the_node_that_never_joined():
    with two_hosts() as pair:
        node0, _ = pair.hosts
        command = node_command(node0, 0, node0, node0.ifname, "--timeout", "3")
        (result,) = run_nodes([(command, {})])
    document = report(result)
    assert result.returncode == 1
    row = failed(document)["store rendezvous"]
    assert "node(s) 1 of 2 did not join" in row["detail"]
    assert "--node-rank" in row["fix"]


@pytest.mark.netns
def test_probe_on_the_wrong_interface_fails_in_bounded_time():
    """Node 1 names loopback, so its rank advertises 127.0.0.1 and node 0 cannot reach it:
    the classic hang at init. The probe must end, fail the stage and say why."""
    with two_hosts() as pair:
        node0, node1 = pair.hosts
        quick = ("--stage-timeout", "3", "--timeout", "30")
        started = time.monotonic()
        results = run_nodes(
            [
                (node_command(node0, 0, node0, node0.ifname, *quick), {}),
                (node_command(node1, 1, node0, "lo", *quick), {}),
            ]
        )
        elapsed = time.monotonic() - started
    assert elapsed < 90
    for result in results:
        document = report(result)
        assert result.returncode == 1
        row = failed(document)["process group"]
        assert "loopback" in row["fix"] and "--ifname" in row["fix"]
        assert {rank["rank"] for rank in document["probe"]["ranks"]} == {0, 1}
    assert (
        "loopback cannot reach other nodes" in failed(report(results[1]))["--ifname lo"]["detail"]
    )
