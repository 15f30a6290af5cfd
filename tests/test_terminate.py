"""SIGTERM when the preemption signal is another one (`--preempt-signal USR1`, SLURM's
`--signal=USR1@90`): an ordinary termination. The run stops at once, without saving, and
the job says so in one line, where it stopped and how to resume; no rank prints its stack."""

from __future__ import annotations

import signal

from test_faults import assert_no_worker_left
from test_preempt import started


def test_sigterm_with_preempt_signal_usr1_is_one_line_not_stacks(tmp_path):
    out = tmp_path / "run"
    run = started(out, "--preempt-signal", "USR1")
    try:
        run.process.send_signal(signal.SIGTERM)
        code = run.finish(timeout=90)
    finally:
        run.kill()
    stderr = run.stderr
    assert code == 1, stderr[-3000:]
    assert "most recent call first" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "none inside the training loop" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith("error: terminated at epoch 1 step "), errors[0]
    assert "SIGTERM, not the preemption signal (--preempt-signal USR1)" in errors[0]
    assert "no checkpoint saved yet" in errors[0] and "exit code 143" not in stderr
    assert f"--out {out} --resume auto" in errors[0]
    assert not list((out / "checkpoints").glob("step-*.pt"))  # terminated, not preempted
    assert_no_worker_left(out)
