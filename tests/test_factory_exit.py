"""A user's factory that calls sys.exit() (a habit of scripts: `sys.exit(main())`) trained
nothing and exited 0, silently. It is the factory's failure: exit 2, naming it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

EXITING = """
import sys


def model(num_classes):
    sys.exit(0)


def data(data_dir, image_size):
    sys.exit(3)
"""

TINY = ["train", "--cpu", "--nproc", "2", "--image-size", "32", "--epochs", "1"]


@pytest.mark.parametrize(
    ("flag", "spec", "words"),
    [
        ("--arch", "exiting:model", "sys.exit(0)"),
        ("--dataset", "exiting:data", "sys.exit(3)"),
        ("--arch", "exits_on_import:model", "SystemExit: 0"),
    ],
)
def test_a_factory_that_calls_sys_exit_is_refused_with_exit_2(tmp_path: Path, flag, spec, words):
    (tmp_path / "exiting.py").write_text(textwrap.dedent(EXITING))
    (tmp_path / "exits_on_import.py").write_text("import sys\n\nsys.exit(0)\n")
    result = run_cli(*TINY, flag, spec, "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"invalid {flag}" in result.stderr and spec.split(":")[0] in result.stderr
    assert words in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
