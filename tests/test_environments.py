"""Who started this process, read from its environment: a launcher's variables that cannot
be a world are exit 2 naming the variable, before any rank waits; SLURM's variables make a
world only inside srun, and the run says which variables made it before it waits; a task
that sees one GPU uses it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, clean_env, free_port, run_cli

from ddpcli.environments import read_launcher_env
from ddpcli.errors import DdpcliError

# What srun sets in each task of a two-task step (less the node list and the job's ids).
SRUN_TASK = {
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NAME": "train",
}  # fmt: skip


def refusal(env: dict[str, str]) -> str:
    with pytest.raises(DdpcliError) as refused:
        read_launcher_env(env)
    assert refused.value.exit_code == 2
    return refused.value.message


# --- 34.19: variables that cannot be a world are exit 2, naming the variable ----------------


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "invalid RANK:"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "invalid WORLD_SIZE:"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "invalid LOCAL_RANK:"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "invalid MASTER_PORT:"),
        ({**SRUN_TASK, "SLURM_PROCID": "x"}, "invalid SLURM_PROCID:"),
        ({**SRUN_TASK, "SLURM_LOCALID": "-1"}, "invalid SLURM_LOCALID:"),
        ({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "2x"}, "invalid SLURM_STEP_NUM_TASKS:"),
    ],
    ids=["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SLURM_PROCID", "SLURM_LOCALID",
         "SLURM_STEP_NUM_TASKS"],
)  # fmt: skip
def test_a_launcher_variable_that_is_no_number_is_exit_2_naming_it(env, said):
    message = refusal(env)
    assert message.startswith(said), message
    assert "int()" not in message


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"RANK": "5", "WORLD_SIZE": "2"}, "invalid RANK: 5 is not below WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "invalid WORLD_SIZE:"),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "invalid LOCAL_RANK: 2 is not below LOCAL_WORLD_SIZE=2",
        ),
        (
            {**SRUN_TASK, "SLURM_PROCID": "5"},
            "invalid SLURM_PROCID: 5 is not below SLURM_STEP_NUM_TASKS=2",
        ),
    ],
    ids=["rank", "world", "local rank", "slurm rank"],
)
def test_a_rank_outside_its_world_is_exit_2(env, said):
    assert refusal(env).startswith(said)


def test_rank_beyond_the_world_is_refused_before_waiting(tmp_path):
    """`RANK=5 WORLD_SIZE=2` waited for --timeout and printed C++ frames: now exit 2 at once."""
    started = time.monotonic()
    env = {"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    result = run_cli(
        "train", "--cpu", "--timeout", "15", "--out", str(tmp_path / "run"),
        env={**env, "MASTER_PORT": str(free_port())}, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "invalid RANK: 5 is not below WORLD_SIZE=2" in result.stderr
    assert "frame #" not in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 15


def given_environment(monkeypatch, env: dict[str, str]) -> None:
    """ENV in this process's environment, as run_cli(env=ENV) gives it to a command (after
    in_process took every launcher's variable away): the dry runs and refusals that read it
    start no rank, so they run in this process. What a command sets for itself there
    (bench-barrier's TORCH_CPP_LOG_LEVEL) is undone with the rest after the test."""
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "placeholder")
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL")
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_rank_without_a_master_is_exit_2_unless_an_init_method_says_where(
    tmp_path, in_process, monkeypatch
):
    """env:// needs MASTER_ADDR and MASTER_PORT; --init-method tcp:// gives the place itself."""
    given_environment(monkeypatch, {"RANK": "1", "WORLD_SIZE": "2"})
    out = ("--out", str(tmp_path / "run"))
    result = in_process("train", "--cpu", "--dry-run", *out)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "MASTER_ADDR" in result.stderr and "--init-method" in result.stderr
    assert "Traceback" not in result.stderr
    given = in_process(
        "train", "--cpu", "--dry-run", "--init-method", "tcp://127.0.0.1:23456", *out
    )
    assert given.returncode == 0, given.stderr[-2000:]


def test_a_bad_rank_is_exit_2_in_every_command_that_reads_the_launcher(in_process, monkeypatch):
    given_environment(monkeypatch, {"RANK": "abc", "WORLD_SIZE": "2"})
    result = in_process("bench-barrier", "--iters", "1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "invalid RANK:" in result.stderr and "Traceback" not in result.stderr


# --- 34.20: SLURM's variables make a world only inside srun, and the run says so -------------


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "r18"},  # sbatch's shell
        {"SLURM_NTASKS": "4", "SLURM_JOB_NAME": "interactive"},  # an salloc shell
        {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1"},  # `srun --pty bash`: a one-task step
    ],
    ids=["batch shell", "salloc shell", "one-task step"],
)
def test_slurm_variables_outside_an_srun_step_make_no_world(env):
    assert read_launcher_env(env) is None


def test_an_srun_task_reads_the_steps_world():
    launcher = read_launcher_env({**SRUN_TASK, "SLURM_NTASKS": "8"})  # the job's, not the step's
    assert launcher is not None and launcher.launcher == "slurm"
    assert (launcher.rank, launcher.world_size, launcher.local_rank) == (1, 2, 1)
    assert "SLURM_PROCID=1" in launcher.describe() and "SLURM_STEP_NUM_TASKS=2" in (
        launcher.describe()
    )


def test_the_batch_shells_slurm_variables_leave_nproc_in_charge_and_are_named(
    in_process, monkeypatch
):
    """An sbatch script's shell (SLURM_PROCID=0, the job's SLURM_NTASKS, no step): ddpcli
    starts --nproc processes itself, and the header says why SLURM's variables were not used."""
    given_environment(monkeypatch, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "77"})
    result = in_process("train", "--cpu", "--nproc", "3", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads(result.stdout)
    assert config["world_size"] == 3
    assert "SLURM_NTASKS=4" in config["world_from"] and "srun" in config["world_from"]


def test_an_srun_task_says_which_variables_made_its_world_before_it_waits(tmp_path):
    """Rank 1 of a step whose rank 0 never comes: before waiting it names SLURM's variables
    and where it waits; then it gives up after --timeout."""
    env = {**SRUN_TASK, "SLURM_NODELIST": "localhost", "MASTER_PORT": str(free_port())}
    result = run_cli(
        "train", "--cpu", "--timeout", "3", "--out", str(tmp_path / "run"), env=env, timeout=90
    )
    assert result.returncode == 1, result.stderr[-2000:]
    waiting = next(line for line in result.stderr.splitlines() if "SLURM_PROCID=1" in line)
    assert "SLURM_STEP_NUM_TASKS=2" in waiting and "localhost" in waiting
    assert "3 s" in waiting or "3s" in waiting
    assert result.stderr.index(waiting) < result.stderr.index("could not join")


# --- 40.5: one GPU visible (srun --gpus-per-task=1): that GPU, whatever the local rank ------


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA facts faked: N visible devices; returns the devices set_device was given."""
    import torch

    chosen: list[torch.device] = []

    def with_devices(count: int) -> list[torch.device]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen

    return with_devices


def test_a_task_that_sees_one_gpu_uses_it_whatever_its_local_rank(fake_cuda):
    from ddpcli.dist import choose_device

    chosen = fake_cuda(1)
    assert str(choose_device(3, want_gpu=True)) == "cuda:0"
    assert [str(device) for device in chosen] == ["cuda:0"]


def test_several_visible_gpus_are_picked_by_local_rank_and_too_few_is_exit_2(fake_cuda):
    from ddpcli.dist import choose_device

    fake_cuda(4)
    assert str(choose_device(3, want_gpu=True)) == "cuda:3"
    with pytest.raises(DdpcliError, match="local rank 2 has no GPU: this process sees 2"):
        fake_cuda(2)
        choose_device(2, want_gpu=True)


@pytest.mark.gpu
def test_a_task_given_one_real_gpu_uses_it_at_any_local_rank():
    """srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds one GPU, SLURM_LOCALID counts on."""
    code = (
        "import torch; from ddpcli.dist import choose_device; "
        "device = choose_device(1, want_gpu=True); "
        "print(device, torch.cuda.current_device())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
        env=clean_env(CUDA_VISIBLE_DEVICES="0"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["cuda:0", "0"]


def test_a_tcp_init_method_under_the_agent_is_served_by_rank_0():
    """Under an elastic agent (TORCHELASTIC_USE_AGENT_STORE), --init-method tcp://HOST:PORT
    names rank 0's own store, not the agent's: rank 0 serves it, as torch 2.14 has it (torch
    2.11 made every rank a client of a store nobody served; seen on two hosts)."""
    import datetime

    import torch.distributed as dist

    from ddpcli.dist import rendezvous_args
    from ddpcli.environments.world import LauncherEnv

    port = free_port()
    agent = {"master_addr": "127.0.0.1", "master_port": free_port(), "agent_store": True}
    env = LauncherEnv(rank=0, local_rank=0, world_size=2, local_world_size=1, **agent)
    served: dict = {}  # rank 0's store waits for the world's other rank to dial it
    serving = threading.Thread(
        target=lambda: served.update(rendezvous_args(env, f"tcp://127.0.0.1:{port}", 10))
    )
    serving.start()
    client = dist.TCPStore(
        "127.0.0.1", port, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    serving.join(timeout=15)
    client.set("from-rank-1", "here")
    assert served["store"].get("from-rank-1") == b"here"
