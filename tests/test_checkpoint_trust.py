"""Nothing in a checkpoint runs: not its pickles (tests/test_checkpoint.py) and not the code
its config names. A checkpoint whose `config.arch` is an import path (`/dir/payload.py:make`
or `module:fn`) is a stranger's code; no command imports it unless the user names the same
`--arch` (or passes --trust-checkpoint-code). Built-in, torchvision and timm names are
rebuilt from the file as before."""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from test_checkpoint import invoke, training_payload

from ddpcli.checkpoint.trust import model_to_rebuild
from ddpcli.files import atomic_save

PAYLOAD = """
from pathlib import Path

Path({marker!r}).write_text("imported")  # what a stranger's module does when imported


def make(num_classes=10, **kwargs):
    from ddpcli.models.build import TinyCNN

    Path({marker!r}).write_text("called")

    return TinyCNN(num_classes)
"""


class Crafted:
    """A genuine tinycnn checkpoint whose config names a payload module as its arch."""

    def __init__(self, folder: Path, form: str) -> None:
        folder.mkdir(exist_ok=True)
        self.folder, self.marker = folder, folder / "MARKER"
        module = f"payload_{uuid.uuid4().hex[:8]}"  # fresh: never cached in sys.modules
        source = folder / f"{module}.py"
        source.write_text(textwrap.dedent(PAYLOAD.format(marker=str(self.marker))))
        self.arch = f"{source}:make" if form == "file" else f"{module}:make"
        self.path = folder / "crafted.pt"
        payload = training_payload()
        payload["config"]["arch"] = self.arch
        payload["world_size"], payload["rng"] = 1, payload["rng"][:1]
        atomic_save(payload, self.path)


@pytest.fixture(params=["file", "module"])
def crafted(request, tmp_path, monkeypatch) -> Crafted:
    # The module form imports from the current folder, as a user's `mods:tiny` would.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    return Crafted(tmp_path, request.param)


def test_the_payload_would_run_if_imported(crafted):
    from ddpcli.factories import load_factory

    load_factory(crafted.arch, "--arch")  # what verify did with the file's arch
    assert crafted.marker.exists()


def test_verify_skips_the_model_check_and_says_why(crafted):
    result = invoke("checkpoint", "verify", str(crafted.path), "--json")
    assert result.exit_code == 0, result.stderr
    checks = {check["check"]: check for check in json.loads(result.stdout)["checks"]}
    assert checks["model"]["status"] == "skip"
    detail = checks["model"]["detail"]
    assert crafted.arch in detail and "--trust-checkpoint-code" in detail
    assert f"--arch {crafted.arch}" in detail
    assert not crafted.marker.exists()


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_inspect_and_convert_never_import_it(crafted, command):
    extra = [str(crafted.folder / "out.pt")] if command == "convert" else []
    result = invoke("checkpoint", command, str(crafted.path), *extra)
    assert result.exit_code == 0, result.stderr
    assert not crafted.marker.exists()


def model_check(*verify_args: str) -> dict[str, str]:
    result = invoke("checkpoint", "verify", *verify_args, "--json")
    assert result.exit_code == 0, result.stderr
    return next(c for c in json.loads(result.stdout)["checks"] if c["check"] == "model")


def test_the_users_own_arch_or_trust_builds_it(crafted):
    check = model_check(str(crafted.path), "--arch", crafted.arch)
    assert check["status"] == "pass" and "accepts all 20 tensors" in check["detail"]
    assert crafted.marker.exists()
    crafted.marker.unlink()
    check = model_check(str(crafted.path), "--trust-checkpoint-code")
    assert check["status"] == "pass" and crafted.marker.exists()


def test_another_arch_given_is_built_instead(crafted):
    check = model_check(str(crafted.path), "--arch", "tinycnn")
    assert check["detail"] == "tinycnn(num_classes=10) accepts all 20 tensors"
    assert not crafted.marker.exists()


TRAIN = [
    "train", "--cpu", "--nproc", "1", "--arch", "tinycnn", "--image-size", "16",
    "--synthetic-size", "32", "--per-gpu-batch", "16", "--max-steps", "1",
]  # fmt: skip


@pytest.mark.parametrize("form", ["file", "module"])
def test_train_resume_refuses_its_arch_and_init_from_never_imports_it(
    tmp_path, monkeypatch, in_process, form
):
    """--resume: the launcher reads the file and refuses another arch than the run's, naming
    the stored one without importing it (in-process: no worker starts). --init-from: the
    launcher and the workers read it and train from its weights, never importing it."""
    monkeypatch.chdir(tmp_path)
    crafted = Crafted(tmp_path / "crafted", form)
    monkeypatch.syspath_prepend(str(crafted.folder))
    refused = in_process(*TRAIN, "--out", str(tmp_path / "resumed"), "--resume", str(crafted.path))
    assert refused.returncode == 2, refused.stderr
    assert f"it was trained with --arch {crafted.arch}" in refused.stderr
    assert not crafted.marker.exists()
    result = run_cli(
        *TRAIN, "--out", str(tmp_path / "run"), "--init-from", str(crafted.path),
        cwd=tmp_path, env={"PYTHONPATH": f"{REPO}:{crafted.folder}"}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--init-from {crafted.path}: loaded 20 tensors" in result.stderr, result.stderr[-3000:]
    assert not crafted.marker.exists()


@pytest.mark.parametrize(
    ("stored", "given", "trust", "built"),
    [
        ("tinycnn", None, False, "tinycnn"),
        ("resnet18", None, False, "resnet18"),
        ("timm:resnet18", None, False, "timm:resnet18"),
        ("timm:hf-hub:someone/model", None, False, None),  # fetches a stranger's config
        ("/x/payload.py:make", None, False, None),
        ("payload:make", None, False, None),
        ("payload.make", None, False, None),
        ("payload:make", "payload:make", False, "payload:make"),
        ("payload:make", None, True, "payload:make"),
        ("payload:make", "tinycnn", False, "tinycnn"),
        (None, None, False, None),
        (["not", "a", "name"], None, False, None),
    ],
)
def test_the_one_rule_every_command_uses(stored, given, trust, built):
    choice = model_to_rebuild({"arch": stored, "model_args": {}}, given, trust)
    assert choice.arch == built
    assert bool(choice.reason) == (built is None)


def test_stored_model_args_that_fetch_files_need_the_users_word():
    config = {"arch": "timm:resnet18", "model_args": {"pretrained": True}}
    choice = model_to_rebuild(config, None, trust_code=False)
    assert choice.arch is None and "pretrained" in choice.reason
    assert model_to_rebuild(config, "timm:resnet18", trust_code=False).model_args == {
        "pretrained": True
    }
    assert model_to_rebuild(config, "resnet18", trust_code=False).model_args == {}
