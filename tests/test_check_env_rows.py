"""check-env's rows as pure functions: facts built by hand + options -> rows, each row
checked for its status and the words a user reads. No subprocess, no torch."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ddpcli.checkenv import checks, facts, network_checks
from ddpcli.checkenv.facts import Gpu, Master, NodeFacts
from ddpcli.checkenv.report import Report, Row, fail, ok, warn
from ddpcli.config.checkenv import CheckEnvOptions, build_check_options, is_loopback
from ddpcli.errors import DdpcliError
from ddpcli.network import Interface, Route, interface_from_ip

VERSIONS = {
    "python": "3.11.7",
    "torch": "2.14.1",
    "cuda": "13.0",
    "cudnn": "9.1.0",
    "nccl": "2.30.7",
    "driver": "580.1",
}
LO = Interface("lo", True, True, ["127.0.0.1/8"])
ETH0 = Interface("eth0", True, False, ["10.0.0.5/24"])
ETH1 = Interface("eth1", True, False, ["192.168.1.5/24"])
IB0 = Interface("ib0", False, False, [])
LOCAL_MASTER = Master("127.0.0.1", 29500, "127.0.0.1", True, "lo")
REMOTE_MASTER = Master("10.0.0.1", 29500, "10.0.0.1", False, "eth0")


def two_gpus() -> list[Gpu]:
    return [Gpu(0, "H100", 81559, "GPU-aaa", 0), Gpu(1, "H100", 81559, "GPU-bbb", 1)]


def node(**changes) -> NodeFacts:
    """A node with two H100s, CUDA working, and lo/eth0/ib0; change what a test needs."""
    base = NodeFacts(
        host="node-a",
        host_address="10.0.0.5",
        versions=dict(VERSIONS),
        backends={"gloo": True, "nccl": True, "mpi": False},
        cuda_available=True,
        gpus=two_gpus(),
        physical_known=True,
        visible_gpus=2,
        cuda_visible_devices=None,
        invalid_visible_entries=[],
        interfaces=[LO, ETH0, IB0],
        environment={},
    )
    return replace(base, **changes)


def cpu_node(**changes) -> NodeFacts:
    versions = {**VERSIONS, "cuda": "", "cudnn": "", "nccl": "", "driver": ""}
    cpu = dict(
        versions=versions,
        backends={"gloo": True, "nccl": False, "mpi": False},
        cuda_available=False,
        gpus=[],
        physical_known=False,
        visible_gpus=0,
    )
    return node(**{**cpu, **changes})


def options(**flags) -> CheckEnvOptions:
    return build_check_options(flags, environ={})


def by_name(rows: list[Row]) -> dict[str, Row]:
    return {row.name: row for row in rows}


# --- Options ---------------------------------------------------------------------------------


def test_options_take_master_address_and_port_from_the_environment():
    found = build_check_options({}, environ={"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456"})
    assert (found.master_addr, found.master_port, found.port_given) == ("10.0.0.1", 23456, True)


def test_options_flags_win_over_the_environment():
    found = build_check_options(
        {"master_addr": "10.0.0.2", "master_port": 1234}, environ={"MASTER_ADDR": "10.0.0.1"}
    )
    assert (found.master_addr, found.master_port, found.port_given) == ("10.0.0.2", 1234, True)


def test_options_without_a_port_keep_the_default_and_say_it_was_not_given():
    found = options()
    assert (found.master_port, found.port_given, found.multi_node) == (29500, False, False)


def test_options_reject_a_master_port_that_is_not_a_number():
    with pytest.raises(DdpcliError) as caught:
        build_check_options({}, environ={"MASTER_PORT": "http"})
    assert caught.value.exit_code == 2 and "MASTER_PORT='http' is not a port number" in str(
        caught.value
    )


def test_options_reject_a_node_rank_not_below_nnodes():
    with pytest.raises(DdpcliError) as caught:
        options(nnodes=2, node_rank=2, master_addr="10.0.0.1")
    assert "invalid --node-rank: 2 must be below --nnodes 2 (0..1)" in caught.value.message


def test_options_reject_a_loopback_master_for_several_nodes():
    with pytest.raises(DdpcliError) as caught:
        options(nnodes=2, master_addr="localhost")
    assert "--nnodes 2 needs node 0's address" in caught.value.message


def test_options_name_the_flag_out_of_range():
    with pytest.raises(DdpcliError) as caught:
        options(master_port=70000)
    assert caught.value.exit_code == 2 and "invalid --master-port" in caught.value.message


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("localhost", True),
     ("10.0.0.1", False), ("node0", False)],
)  # fmt: skip
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


# --- Versions and backends -------------------------------------------------------------------


def test_versions_with_working_cuda():
    rows = by_name(checks.version_rows(node(), options()))
    assert rows["Python"].detail == "3.11.7" and rows["torch"].detail == "2.14.1"
    assert rows["CUDA"].status == "ok"
    assert rows["CUDA"].detail == "13.0, driver 580.1; 2 GPU(s) visible to torch"
    assert rows["cuDNN"].detail == "9.1.0" and rows["NCCL"].detail == "2.30.7"
    assert rows["MPI backend"].detail.startswith("not built in")


def test_cuda_on_a_cpu_only_node_is_fine():
    row = checks.cuda_row(cpu_node())
    assert row.status == "ok"
    assert row.detail == "CPU-only torch build; no GPU on this node, so runs use Gloo on the CPU"


def test_cpu_only_torch_on_a_gpu_node_fails_as_train_refuses_it():
    facts_ = node(versions={**VERSIONS, "cuda": ""}, cuda_available=False, visible_gpus=0)
    row = checks.cuda_row(facts_)
    assert row.status == "fail"
    assert row.detail == "torch 2.14.1 is a CPU-only build, but nvidia-smi lists 2 GPU(s)"
    assert "install a CUDA build of torch" in row.fix and "--cpu" in row.fix


def test_cuda_build_that_cannot_use_the_gpus_fails_naming_the_driver():
    row = checks.cuda_row(node(cuda_available=False, visible_gpus=0))
    assert row.status == "fail"
    assert row.detail == (
        "torch 2.14.1 (CUDA 13.0) cannot use the 2 GPU(s) nvidia-smi lists with driver 580.1"
    )
    assert "driver supports CUDA 13.0" in row.fix


def test_a_driver_too_old_for_torchs_cuda_is_named_with_the_one_needed():
    """The cu130 wheel on a cluster's 535 driver: CUDA 13 needs 580 or newer."""
    versions = {**VERSIONS, "driver": "535.104.05"}
    row = checks.cuda_row(node(versions=versions, cuda_available=False, visible_gpus=0))
    assert row.status == "fail"
    assert row.detail == (
        "torch 2.14.1 (CUDA 13.0) cannot use the 2 GPU(s) nvidia-smi lists with driver "
        "535.104.05: CUDA 13 needs driver 580 or newer"
    )
    assert row.fix.startswith("install a driver of 580 or newer, or a torch build for an older")


def test_cuda_when_cuda_visible_devices_hides_every_gpu():
    gpus = [Gpu(0, "H100", 81559, "GPU-aaa"), Gpu(1, "H100", 81559, "GPU-bbb")]
    facts_ = node(cuda_available=False, visible_gpus=0, gpus=gpus, cuda_visible_devices="")
    row = checks.cuda_row(facts_)
    assert row.status == "ok" and "CUDA_VISIBLE_DEVICES hides every GPU" in row.detail


def test_missing_nccl_fails_only_when_asked_for():
    facts_ = node(versions={**VERSIONS, "nccl": ""})
    asked = checks.nccl_row(facts_, options(backend="nccl"))
    assert asked.status == "fail" and "--backend nccl asks for it" in asked.detail
    assert "--backend gloo" in asked.fix
    auto = checks.nccl_row(facts_, options())
    assert auto.status == "ok" and auto.detail == "not in this torch build (CPU runs use Gloo)"


def test_missing_cudnn_is_only_noted():
    row = by_name(checks.version_rows(cpu_node(), options()))["cuDNN"]
    assert row.status == "ok" and "not available" in row.detail


def test_backend_without_gloo_fails():
    facts_ = cpu_node(backends={"gloo": False, "nccl": False, "mpi": False})
    row = by_name(checks.backend_rows(facts_, options()))["Gloo backend"]
    assert row.status == "fail" and "install an official torch wheel" in row.fix


def test_backend_without_nccl_fails_when_runs_would_use_gpus():
    facts_ = node(backends={"gloo": True, "nccl": False, "mpi": True})
    rows = by_name(checks.backend_rows(facts_, options()))
    assert rows["NCCL backend"].status == "fail"
    assert rows["NCCL backend"].detail == "not available, but runs here would use GPUs"
    assert rows["MPI backend"].detail == "available"


def test_backend_without_nccl_is_fine_on_the_cpu():
    row = by_name(checks.backend_rows(cpu_node(), options()))["NCCL backend"]
    assert row.status == "ok" and row.detail == "not available (not needed on the CPU)"


# --- GPUs and CUDA_VISIBLE_DEVICES -----------------------------------------------------------


def test_unset_cuda_visible_devices():
    row = checks.visible_devices_row(node())
    assert row.status == "ok" and row.detail.startswith("unset: a process sees every GPU")
    assert row.detail.endswith("`ddpcli train` without --gpus uses them all")


def test_empty_cuda_visible_devices_warns():
    row = checks.visible_devices_row(node(cuda_visible_devices=" "))
    assert row.status == "warn" and "set but empty" in row.detail
    assert "unset CUDA_VISIBLE_DEVICES" in row.fix


def test_cuda_visible_devices_naming_no_gpu_warns():
    facts_ = node(cuda_visible_devices="0,7", invalid_visible_entries=["7"])
    row = checks.visible_devices_row(facts_)
    assert row.status == "warn"
    assert "0,7: 7 names no GPU here (or repeats one)" in row.detail
    assert "each once" in row.fix


def test_cuda_visible_devices_renumbering_is_spelled_out():
    gpus = [Gpu(0, "H100", 81559, "GPU-aaa", 1), Gpu(1, "H100", 81559, "GPU-bbb", 0)]
    row = checks.visible_devices_row(node(cuda_visible_devices="1,0", gpus=gpus))
    assert row.status == "ok"
    assert row.detail.startswith("1,0 (GPU 0 is cuda:1, GPU 1 is cuda:0 inside a process); ")
    assert "`ddpcli train` uses only these GPUs (--gpus picks among them" in row.detail


def test_gpu_rows_say_where_each_gpu_is_seen():
    gpus = [Gpu(0, "H100", 81559, "GPU-aaa", None), Gpu(1, "H100", 81559, "GPU-bbb", 0)]
    facts_ = node(cuda_visible_devices="1", gpus=gpus, visible_gpus=1)
    rows = by_name(checks.gpu_rows(facts_, options()))
    assert rows["GPU 0"].detail == "H100 · 80 GiB · hidden by CUDA_VISIBLE_DEVICES"
    assert rows["GPU 1"].detail == (
        "H100 · 80 GiB · cuda:0 inside a process (CUDA_VISIBLE_DEVICES renumbers it)"
    )
    assert "GPUs in torch" not in rows


def test_gpu_row_without_nvidia_smi_uses_the_torch_index():
    row = checks.gpu_row(Gpu(None, "A10", 0, cuda_index=0), node(physical_known=False))
    assert row.name == "GPU cuda:0" and row.detail == "A10 · memory unknown · cuda:0"


def test_no_gpu_is_said_plainly():
    rows = by_name(checks.gpu_rows(cpu_node(), options()))
    assert rows["GPUs"].status == "ok" and rows["GPUs"].detail == "none: runs use Gloo on the CPU"


def test_torch_seeing_fewer_gpus_than_expected_warns():
    row = by_name(checks.gpu_rows(node(visible_gpus=1), options()))["GPUs in torch"]
    assert row.status == "warn"
    assert "torch sees 1 GPU(s) but CUDA_VISIBLE_DEVICES and nvidia-smi give 2" in row.detail


def test_torch_count_is_not_compared_under_mig():
    facts_ = node(cuda_visible_devices="MIG-abc", visible_gpus=1)
    assert checks.torch_sees_row(facts_) == []


def test_more_processes_than_gpus_warns_with_the_right_count():
    row = by_name(checks.gpu_rows(node(), options(nproc=4)))["processes per GPU"]
    assert row.status == "warn"
    assert "--nproc 4 means 4 processes on this node, which has 2 GPU(s)" in row.detail
    assert "local ranks 2..3 have no GPU of their own" in row.detail
    assert "--nproc 2" in row.fix and "torchrun --nproc-per-node 2" in row.fix


def test_one_process_per_gpu_is_ok():
    row = by_name(checks.gpu_rows(node(), options(nproc=2)))["processes per GPU"]
    assert row.status == "ok" and row.detail == "--nproc 2: 2 process(es) for 2 GPU(s)"


def test_world_size_is_divided_between_the_nodes():
    facts_ = node(environment={"WORLD_SIZE": "4"})
    opts = options(nnodes=2, master_addr="10.0.0.1")
    row = by_name(checks.world_size_rows(facts_, opts))["processes per GPU"]
    assert row.status == "ok" and row.detail == "WORLD_SIZE=4: 2 process(es) for 2 GPU(s)"


def test_local_world_size_comes_before_world_size():
    facts_ = node(environment={"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "2"})
    row = by_name(checks.world_size_rows(facts_, options()))["processes per GPU"]
    assert row.status == "warn" and row.detail.startswith("LOCAL_WORLD_SIZE=3 means 3 processes")


def test_world_size_is_not_checked_for_gloo():
    assert checks.world_size_rows(node(), options(backend="gloo", nproc=8)) == []
    assert checks.world_size_rows(node(), options()) == []  # nothing planned


# --- The launcher's variables ----------------------------------------------------------------


def test_no_distributed_variable_set():
    row, tmpdir, bytecode = checks.environment_rows(node(), options())
    assert row.name == "distributed variables" and row.status == "ok"
    assert row.detail.startswith("none set")
    assert tmpdir.name == "TMPDIR" and bytecode.name == "Python bytecode"


def test_torch_compiled_again_by_every_process_is_a_warning(tmp_path, monkeypatch):
    """PYTHONDONTWRITEBYTECODE with torch installed without its .pyc files (pip
    --no-compile): each process compiles torch's Python as it starts."""
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))  # nothing in it
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    row = checks.bytecode_row()
    assert row.status == "warn" and row.detail.startswith("PYTHONDONTWRITEBYTECODE is set")
    assert "every process of a job compiles torch's Python" in row.detail
    assert row.fix.startswith("unset PYTHONDONTWRITEBYTECODE, or compile them once: ")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(checks, "writable_folder", lambda folder: False)  # root writes anywhere
    row = checks.bytecode_row()
    assert row.status == "warn" and "cannot be written" in row.detail, row
    assert row.fix.startswith("export PYTHONPYCACHEPREFIX=")
    monkeypatch.undo()
    assert checks.writable_folder(tmp_path / "not" / "made" / "yet")  # Python makes them


def test_kept_or_keepable_bytecode_is_ok(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    row = checks.bytecode_row()
    assert (row.status, row.detail) == ("ok", "compiled as modules are first imported, then kept")
    compiled = Path(importlib.util.cache_from_source(importlib.util.find_spec("torch").origin))
    compiled.parent.mkdir(parents=True)
    compiled.write_bytes(b"")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # kept already: nothing to write
    row = checks.bytecode_row()
    assert row.status == "ok" and "torch's compiled modules are kept" in row.detail


def test_each_variable_is_shown():
    env = {"MASTER_ADDR": "10.0.0.1", "NCCL_DEBUG": "INFO"}
    rows = by_name(checks.environment_rows(node(environment=env), options()))
    assert rows["MASTER_ADDR"].detail == "MASTER_ADDR=10.0.0.1"
    assert rows["NCCL_DEBUG"].status == "ok"


def test_gloo_socket_ifname_naming_no_interface_fails_listing_usable_ones():
    row = checks.variable_row("GLOO_SOCKET_IFNAME", "eth9", [LO, ETH0, IB0])
    assert row.status == "fail"
    assert row.detail == (
        "GLOO_SOCKET_IFNAME=eth9: names no interface on this node, so a run fails at init"
    )
    assert "export GLOO_SOCKET_IFNAME=IFACE" in row.fix and "(lo, eth0)" in row.fix


def test_nccl_takes_a_prefix_and_gloo_does_not():
    interfaces = [LO, ETH0]
    assert checks.variable_row("NCCL_SOCKET_IFNAME", "eth", interfaces).status == "ok"
    assert checks.variable_row("GLOO_SOCKET_IFNAME", "eth", interfaces).status == "fail"


def test_nccl_exact_name_and_exclusion():
    interfaces = [LO, ETH0]
    assert checks.socket_ifname_problem("NCCL_SOCKET_IFNAME", "=eth", interfaces) == (
        "names no interface on this node"
    )
    assert checks.socket_ifname_problem("NCCL_SOCKET_IFNAME", "=eth0", interfaces) is None
    assert checks.socket_ifname_problem("NCCL_SOCKET_IFNAME", "^docker", interfaces) is None


def test_gloo_takes_a_comma_separated_list():
    assert checks.socket_ifname_problem("GLOO_SOCKET_IFNAME", "eth9,eth0", [ETH0]) is None


def test_socket_ifname_naming_a_down_interface_fails():
    row = checks.variable_row("NCCL_SOCKET_IFNAME", "ib", [LO, ETH0, IB0])
    assert row.status == "fail" and "ib0 is down or holds no address" in row.detail


def test_only_rank_without_world_size_warns():
    (row,) = checks.rank_consistency_rows({"RANK": "0"})
    assert row.status == "warn" and "only one of RANK and WORLD_SIZE is set" in row.detail


def test_rank_not_below_world_size_fails():
    (row,) = checks.rank_consistency_rows({"RANK": "4", "WORLD_SIZE": "4"})
    assert row.status == "fail"
    assert row.detail == "RANK=4 is not below WORLD_SIZE=4: this rank can never join"
    assert "--nnodes/--nproc-per-node" in row.fix


def test_consistent_ranks_add_no_row():
    assert checks.rank_consistency_rows({"RANK": "3", "WORLD_SIZE": "4"}) == []


def test_environment_rows_include_the_rank_check():
    env = {"RANK": "5", "WORLD_SIZE": "2"}
    rows = by_name(checks.environment_rows(node(environment=env), options()))
    assert rows["RANK / WORLD_SIZE"].status == "fail"


# --- Network ---------------------------------------------------------------------------------


def test_interface_rows_mark_the_route_to_the_master():
    rows = by_name(network_checks.network_rows(node(), options(), REMOTE_MASTER))
    assert rows["interface eth0"].detail == "up · 10.0.0.5/24 · the route to the master leaves here"
    assert rows["interface ib0"].detail == "down · no address"


def test_host_name_that_resolves():
    row = network_checks.hostname_row(node(), options())
    assert row.status == "ok" and row.detail == "node-a → 10.0.0.5"


def test_host_name_that_does_not_resolve_needs_an_interface():
    row = network_checks.hostname_row(node(host_address=None), options())
    assert row.status == "warn" and "node-a does not resolve" in row.detail
    assert "--ifname IFACE" in row.fix
    named = network_checks.hostname_row(node(host_address=None), options(ifname="eth0"))
    assert named.status == "ok"


def test_loopback_host_name_is_fine_on_one_node():
    row = network_checks.hostname_row(node(host_address="127.0.1.1"), options())
    assert row.status == "ok" and "loopback: fine on one node" in row.detail


def test_loopback_host_name_warns_on_several_nodes():
    opts = options(nnodes=2, master_addr="10.0.0.1")
    row = network_checks.hostname_row(node(host_address="127.0.1.1"), opts)
    assert row.status == "warn" and "other nodes cannot reach" in row.detail
    env = {"GLOO_SOCKET_IFNAME": "eth0"}
    chosen = network_checks.hostname_row(node(host_address="127.0.1.1", environment=env), opts)
    assert chosen.status == "ok"


def test_several_interfaces_without_a_choice_warn_naming_the_masters():
    facts_ = node(interfaces=[LO, ETH0, ETH1])
    master = replace(REMOTE_MASTER, interface="eth1")
    (row,) = network_checks.several_interfaces_rows(facts_, options(), master)
    assert row.status == "warn"
    assert "2 interfaces carry IPv4 (eth0, eth1) and none is named" in row.detail
    assert row.fix.startswith("pass --ifname eth1")


def test_several_interfaces_with_a_choice_are_fine():
    facts_ = node(interfaces=[LO, ETH0, ETH1], environment={"NCCL_SOCKET_IFNAME": "eth0"})
    assert network_checks.several_interfaces_rows(facts_, options(), REMOTE_MASTER) == []
    assert network_checks.several_interfaces_rows(node(), options(), REMOTE_MASTER) == []


def test_master_that_does_not_resolve_fails():
    master = Master("nohost", 29500, None, False, None)
    (row,) = network_checks.master_rows(options(master_addr="nohost"), master)
    assert row.status == "fail" and row.detail == "nohost does not resolve (within 3s)"
    assert "node 0's IP address" in row.fix


def test_master_on_this_node():
    (row,) = network_checks.master_rows(options(), LOCAL_MASTER)
    assert row.status == "ok" and row.detail == "127.0.0.1:29500 · this node"


def test_master_on_another_host_by_name():
    master = Master("node0", 29500, "10.0.0.1", False, "eth0")
    (row,) = network_checks.master_rows(options(master_addr="node0"), master)
    assert row.detail == "node0 (10.0.0.1):29500 · another host, reached through eth0"


def test_public_master_address_warns_about_the_open_store():
    master = Master("8.8.8.8", 29500, "8.8.8.8", False, "eth0")
    rows = by_name(network_checks.master_rows(options(master_addr="8.8.8.8"), master))
    exposure = rows["master exposure"]
    assert exposure.status == "warn" and "has no authentication" in exposure.detail
    assert "private address" in exposure.fix


def test_master_resolving_to_loopback_fails_on_several_nodes():
    opts = options(nnodes=3, master_addr="node0")
    master = Master("node0", 29500, "127.0.1.1", True, "lo")
    rows = network_checks.master_rows(opts, master)
    failed = [row for row in rows if row.status == "fail"]
    assert failed[0].detail == "node0 (127.0.1.1) is loopback: the other 2 node(s) cannot reach it"


def test_node_rank_0_away_from_the_master_fails():
    opts = options(nnodes=2, master_addr="10.0.0.1")
    rows = by_name(network_checks.master_rows(opts, REMOTE_MASTER))
    assert rows["node rank"].status == "fail"
    assert "--node-rank 0 makes this node the master, but 10.0.0.1" in rows["node rank"].detail


def test_other_node_rank_on_the_master_fails():
    opts = options(nnodes=2, node_rank=1, master_addr="10.0.0.5")
    master = Master("10.0.0.5", 29500, "10.0.0.5", True, "eth0")
    rows = by_name(network_checks.master_rows(opts, master))
    assert rows["node rank"].status == "fail"
    assert "--node-rank 1 says another node is the master" in rows["node rank"].detail


def test_ifname_up_says_which_variables_a_run_sets():
    opts = options(ifname="eth0")
    (row,) = network_checks.ifname_rows(node(), opts, REMOTE_MASTER)
    assert row.name == "--ifname eth0" and row.status == "ok"
    assert row.detail == (
        "up · 10.0.0.5/24 · a run sets GLOO_SOCKET_IFNAME=eth0 and NCCL_SOCKET_IFNAME=eth0"
    )


def test_ifname_replacing_a_variable_says_so():
    facts_ = node(environment={"GLOO_SOCKET_IFNAME": "eth1"})
    assert network_checks.ifname_effect("eth0", facts_).endswith(
        "(replacing GLOO_SOCKET_IFNAME=eth1)"
    )


def test_ifname_down_fails_with_the_alternatives():
    (row,) = network_checks.ifname_rows(node(), options(ifname="ib0"), REMOTE_MASTER)
    assert row.status == "fail" and row.detail == "ib0 is down"
    assert row.fix == "ip link set ib0 up, or choose one of: lo, eth0"


def test_ifname_without_address_fails():
    bare = Interface("eth2", True, False, [])
    facts_ = node(interfaces=[LO, ETH0, bare])
    (row,) = network_checks.ifname_rows(facts_, options(ifname="eth2"), REMOTE_MASTER)
    assert row.status == "fail" and row.detail == "eth2 is up but holds no address"


def test_ifname_loopback_fails_on_several_nodes():
    opts = options(ifname="lo", nnodes=2, node_rank=1, master_addr="10.0.0.1")
    rows = network_checks.ifname_rows(node(), opts, REMOTE_MASTER)
    assert rows[-1].status == "fail" and rows[-1].detail == "loopback cannot reach other nodes"


def test_ifname_off_the_route_to_the_master_warns():
    facts_ = node(interfaces=[LO, ETH0, ETH1])
    rows = by_name(network_checks.ifname_rows(facts_, options(ifname="eth1"), REMOTE_MASTER))
    route = rows["route to the master"]
    assert route.status == "warn"
    assert route.detail == "traffic to the master 10.0.0.1 leaves through eth0, not eth1"
    assert route.fix.startswith("use --ifname eth0")


def test_ifname_the_kernel_knows_but_ip_did_not_list():
    (row,) = network_checks.ifname_rows(node(), options(ifname="veth9"), REMOTE_MASTER)
    assert row.status == "warn" and "could not be read" in row.detail


# --- The master port -------------------------------------------------------------------------


def test_free_port_on_the_master_node():
    port = free_tcp_port()
    (row,) = network_checks.port_rows(options(master_port=port), replace(LOCAL_MASTER, port=port))
    assert row.name == f"master port {port}" and row.status == "ok"
    assert "is free on this node" in row.detail


def test_busy_port_on_the_master_node_fails():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        master = replace(LOCAL_MASTER, port=port)
        (row,) = network_checks.port_rows(options(master_port=port), master)
    assert row.status == "fail" and f"port {port} is busy on this node" in row.detail
    assert "pick a free port (--master-port" in row.fix


def test_remote_master_listening_is_reachable():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        master = Master("127.0.0.1", port, "127.0.0.1", False, "lo")  # as if another host
        (row,) = network_checks.port_rows(options(master_port=port), master)
    assert row.status == "ok" and "is reachable and something listens" in row.detail


def test_remote_master_refusing_is_normal_before_node_0_starts():
    port = free_tcp_port()
    master = Master("127.0.0.1", port, "127.0.0.1", False, "lo")
    (row,) = network_checks.port_rows(options(master_port=port), master)
    assert row.status == "ok" and f"nothing listens on {port} yet" in row.detail


def test_remote_master_unreachable_fails(monkeypatch):
    monkeypatch.setattr(network_checks, "try_connect", lambda host, port: "timeout")
    (row,) = network_checks.port_rows(options(), REMOTE_MASTER)
    assert row.status == "fail"
    assert row.detail == "10.0.0.1:29500 cannot be reached (timeout) within 3s"
    assert "open TCP port 29500" in row.fix


def test_no_port_row_when_the_probe_waits_or_the_name_failed():
    assert network_checks.port_rows(options(probe=True), REMOTE_MASTER) == []
    unresolved = Master("nohost", 29500, None, False, None)
    assert network_checks.port_rows(options(), unresolved) == []


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


# --- Facts, the master and the report --------------------------------------------------------


def test_interface_from_ip_puts_ipv4_first_and_reads_the_state():
    entry = {
        "ifname": "eth0",
        "flags": ["BROADCAST", "UP", "LOWER_UP"],
        "addr_info": [
            {"family": "inet6", "local": "fe80::1", "prefixlen": 64},
            {"family": "inet", "local": "10.0.0.5", "prefixlen": 24},
        ],
    }
    iface = interface_from_ip(entry)
    assert iface.addresses == ["10.0.0.5/24", "fe80::1/64"] and iface.ipv4 == ["10.0.0.5"]
    assert iface.up and not iface.loopback
    no_carrier = interface_from_ip({"ifname": "eth1", "flags": ["UP", "NO-CARRIER"]})
    assert not no_carrier.up and no_carrier.addresses == []


@pytest.mark.parametrize(("number", "text"), [(90100, "9.1.0"), (8907, "8.9.7"), (None, "")])
def test_cudnn_version_text(number, text):
    assert facts.cudnn_version_text(number) == text


def test_master_held_by_this_node_listens_on_the_holder(monkeypatch):
    monkeypatch.setattr(facts, "route_to", lambda ip: pytest.fail("no route needed"))
    master = facts.locate_master(options(master_addr="10.0.0.5"), node())
    assert (master.ip, master.this_node, master.interface) == ("10.0.0.5", True, "eth0")


def test_master_elsewhere_is_reached_through_the_route(monkeypatch):
    monkeypatch.setattr(facts, "route_to", lambda ip: Route("eth0", "10.0.0.5"))
    master = facts.locate_master(options(master_addr="10.0.0.1"), node())
    assert (master.this_node, master.interface, master.loopback) == (False, "eth0", False)


def test_hosts_master_follows_node_rank_on_several_nodes():
    several = options(nnodes=2, master_addr="10.0.0.1")
    assert facts.hosts_master(several, REMOTE_MASTER)
    assert not facts.hosts_master(options(), REMOTE_MASTER)
    assert facts.hosts_master(options(), LOCAL_MASTER)


def test_report_counts_and_exit_code():
    report = Report([ok("a", "x"), warn("b", "y", "z"), fail("c", "w", "v")], node(), LOCAL_MASTER)
    assert report.counts == {"ok": 1, "warn": 1, "fail": 1} and report.failed
    document = report.to_json()
    assert document["ok"] is False and document["exit_code"] == 1
    assert document["probe"] is None and document["master"]["addr"] == "127.0.0.1"
    assert [row["name"] for row in document["checks"]] == ["a", "b", "c"]


def test_report_with_probe_adds_its_rows_in_their_own_section():
    report = Report([ok("a", "x")], node(), LOCAL_MASTER)
    probed = report.with_probe([fail("port open", "busy", "pick")], {"ran": False})
    assert not report.failed and probed.failed
    assert [(row.name, row.section) for row in probed.rows] == [("a", ""), ("port open", "probe")]
    assert probed.to_json()["probe"] == {"ran": False}


def test_run_checks_orders_the_sections(monkeypatch):
    monkeypatch.setattr(checks, "collect_facts", lambda: cpu_node())
    monkeypatch.setattr(checks, "locate_master", lambda opts, facts_: LOCAL_MASTER)
    report = checks.run_checks(options(master_port=free_tcp_port()))
    sections = list(dict.fromkeys(row.section for row in report.rows))
    assert sections == ["versions", "GPUs", "environment", "network", "ports"]
    assert report.probe is None and not report.failed


def test_run_checks_refuses_an_interface_that_does_not_exist(monkeypatch):
    monkeypatch.setattr(checks, "collect_facts", lambda: pytest.fail("must stop before"))
    with pytest.raises(DdpcliError) as caught:
        checks.run_checks(options(ifname="nosuch0"))
    assert caught.value.exit_code == 2 and "'nosuch0' does not exist" in caught.value.message
