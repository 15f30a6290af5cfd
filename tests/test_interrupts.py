"""A Ctrl-C that comes while torch is being imported is taken once the import is done, in a
ddpcli command and in a launched script alike: inside torch's import a KeyboardInterrupt can
be lost (its C++ start-up reads a failed numpy import as "no numpy"), and a launcher that lost
one ran its job on. A stand-in torch loses it the same way, at a moment the test picks; each
command is started as a new interpreter, as a user starts it (the tests' zygote has torch).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, answer_ctrl_c, clean_env, free_port, ignores_ctrl_c

# Long enough that the test's SIGINT lands inside it, short enough to wait out when held.
IMPORT_S = 2

STAND_IN_TORCH = f"""
    import sys, time
    print("torch: importing", file=sys.stderr, flush=True)
    try:
        time.sleep({IMPORT_S})
    except KeyboardInterrupt:
        pass  # lost, as torch's C++ start-up loses one in its numpy import
    print("torch: imported", file=sys.stderr, flush=True)
"""


@pytest.fixture
def stand_in_torch(tmp_path):
    package = tmp_path / "fake" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(STAND_IN_TORCH))
    return clean_env(PYTHONPATH=f"{package.parent}:{REPO}")


def ctrl_c_once_it_says(
    command: list[str], env: dict[str, str], cwd, marker: str, after_s: float = 0
):
    """COMMAND's exit code, stdout and stderr, with a SIGINT sent AFTER_S once it prints
    MARKER on stderr (the stand-in torch: "torch: importing")."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
        preexec_fn=answer_ctrl_c if ignores_ctrl_c() else None,
    )  # fmt: skip
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if marker in line:
                time.sleep(after_s)
                process.send_signal(signal.SIGINT)
                break
        stdout, rest = process.communicate(timeout=60)
        return process.returncode, stdout, "".join(lines) + rest
    finally:
        process.kill()


def test_a_command_takes_the_ctrl_c_once_torch_is_in(stand_in_torch, tmp_path):
    command = [sys.executable, "-m", "ddpcli", "check-env"]
    code, _, stderr = ctrl_c_once_it_says(command, stand_in_torch, tmp_path, "torch: importing")
    assert code == 130, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines == ["torch: importing", "torch: imported", "error: interrupted"], stderr


def test_a_launched_script_takes_the_ctrl_c_once_torch_is_in(stand_in_torch, tmp_path):
    """The bootstrap that runs each worker of `ddpcli launch` holds it for the script's own
    import (the launcher passes Ctrl-C on to every worker)."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nprint('the script went on', flush=True)\n")
    command = [sys.executable, "-m", "ddpcli.launcher.bootstrap", str(script)]
    env = {**stand_in_torch, "RANK": "0"}
    code, stdout, stderr = ctrl_c_once_it_says(command, env, tmp_path, "torch: importing")
    assert code == 130, stderr[-2000:]
    assert "torch: imported" in stderr and "Traceback" not in stderr, stderr
    assert "went on" not in stdout


def test_a_worker_interrupted_before_its_script_starts_ends_at_once_and_quietly(tmp_path):
    """The Ctrl-C the agent passes on can reach a worker still importing the bootstrap's own
    modules (a second or more on a busy machine; rich is one): Python's own printed a
    traceback of those imports on every such worker."""
    stand_in = tmp_path / "fake" / "rich"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(
        "import sys, time\nprint('rich: importing', file=sys.stderr, flush=True)\ntime.sleep(30)\n"
    )
    script = tmp_path / "train.py"
    script.write_text("print('the script ran', flush=True)\n")
    env = clean_env(PYTHONPATH=f"{stand_in.parent}:{REPO}", RANK="0")
    command = [sys.executable, "-m", "ddpcli.launcher.bootstrap", str(script)]
    code, stdout, stderr = ctrl_c_once_it_says(command, env, tmp_path, "rich: importing")
    assert code == 130, stderr[-2000:]
    assert stderr.strip() == "rich: importing" and stdout == ""


@pytest.fixture
def slow_typer(tmp_path):
    """A stand-in typer that takes its time, as the command line's modules do on a busy
    machine (the real ones: half a second idle, over 1.5 s beside three busy loops)."""
    stand_in = tmp_path / "fake" / "typer"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(
        "import sys, time\nprint('typer: importing', file=sys.stderr, flush=True)\ntime.sleep(30)\n"
    )
    return clean_env(PYTHONPATH=f"{stand_in.parent}:{REPO}")


def installed_command() -> list[str]:
    """The `ddpcli` that `pip install` wrote beside this interpreter."""
    script = Path(sys.executable).with_name("ddpcli")
    if not script.exists():
        pytest.skip(f"no {script}: ddpcli is not installed in this environment")
    return [str(script)]


@pytest.mark.parametrize("started_as", ["python -m ddpcli", "ddpcli"])
def test_a_ctrl_c_while_the_command_line_loads_ends_it_with_one_line(
    started_as, slow_typer, tmp_path
):
    command = [sys.executable, "-m", "ddpcli"] if started_as != "ddpcli" else installed_command()
    code, stdout, stderr = ctrl_c_once_it_says(
        [*command, "check-env"], slow_typer, tmp_path, "typer: importing"
    )
    assert code == 130, stderr[-2000:]
    assert stderr.splitlines() == ["typer: importing", "error: interrupted"], stderr
    assert stdout == ""


JOIN_ALONE = """
    import sys
    from ddpcli.dist import init_distributed
    from ddpcli.environments import read_launcher_env

    print("joining", file=sys.stderr, flush=True)
    init_distributed(read_launcher_env(), want_gpu=False, backend="gloo", init_method=None,
                     timeout_s=60)
"""


@pytest.mark.parametrize("started_by", ["hand", "an elastic agent"])
def test_a_ctrl_c_ends_a_rank_waiting_in_cpp_for_a_peer_that_never_comes(started_by, tmp_path):
    """A rank joining the process group waits in C++ for its peers, where Python's handler
    never runs: a peer that the same Ctrl-C ended never comes, and the rank waited out the
    group's timeout (here 60 s), or the launcher's 30 s grace. It ends within the grace,
    saying so where no launcher speaks for it."""
    from ddpcli.interrupts import STUCK_AFTER_CTRL_C_S

    script = tmp_path / "join.py"
    script.write_text(textwrap.dedent(JOIN_ALONE))
    env = clean_env(
        PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **({"TORCHELASTIC_RUN_ID": "test"} if started_by != "hand" else {}),
    )  # fmt: skip
    started = time.monotonic()
    code, stdout, stderr = ctrl_c_once_it_says(
        [sys.executable, str(script)], env, tmp_path, "joining", after_s=1
    )  # by then waiting in C++ (joining takes milliseconds to get there)
    assert code == 130, stderr[-2000:]
    said = ["error: interrupted"] if started_by == "hand" else []  # else its launcher says it
    assert stderr.splitlines() == ["joining", *said] and stdout == "", stderr
    assert time.monotonic() - started < STUCK_AFTER_CTRL_C_S + 20


def test_a_ctrl_c_the_block_takes_itself_is_the_usual_keyboard_interrupt(tmp_path):
    """Where the wait returns to Python (here it never left it), the block's own handling of
    the Ctrl-C stands, and the watch ends with the block."""
    script = tmp_path / "wait.py"
    script.write_text(textwrap.dedent("""
        import sys, threading, time
        from ddpcli.interrupts import ctrl_c_ends_a_stuck_wait
        try:
            with ctrl_c_ends_a_stuck_wait(grace_s=1):
                print("waiting", file=sys.stderr, flush=True)
                time.sleep(30)
        except KeyboardInterrupt:
            time.sleep(2)  # past the grace: no exit from the watch
            print(f"taken, threads: {threading.active_count()}", flush=True)
    """))  # fmt: skip
    command = [sys.executable, str(script)]
    env = clean_env(PYTHONPATH=str(REPO))
    code, stdout, stderr = ctrl_c_once_it_says(command, env, tmp_path, "waiting")
    assert (code, stdout) == (0, "taken, threads: 1\n"), stderr[-2000:]
