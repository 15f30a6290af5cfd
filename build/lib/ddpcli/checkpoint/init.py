"""`--init-from PATH`: start a run from someone's weights (fine-tuning), not from a resume.

Only the model's tensors are taken, from a ddpcli checkpoint, a `ddpcli checkpoint convert`
output (a .safetensors file's header naming its classes too) or a plain state dict (loaded
with weights_only=True); the step counter, optimiser and schedule start fresh.
`--reset-head` leaves the final classifier as the model built it, for a data set with other
classes; without it, a header that names another class count is refused. Missing and
unexpected names are reported, not refused (a backbone without its head is the usual case);
a shape that differs outside the head would silently train something else, so it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpcli.checkpoint.loading import (
    listed_briefly,
    model_state,
    non_finite_tensors,
    safe_load,
    strip_ddp_prefix,
)
from ddpcli.checkpoint.safetensors_io import is_safetensors_file, read_safetensors
from ddpcli.errors import USAGE, DdpcliError, usage_error

SHOWN_NAMES = 6  # names listed per group; the rest are counted


@dataclass
class InitReport:
    """Which of the model's tensors came from the file, and which did not."""

    path: Path
    loaded: list[str]
    missing: list[str] = field(default_factory=list)  # in the model, not in the file
    unexpected: list[str] = field(default_factory=list)  # in the file, not in the model
    reset: list[str] = field(default_factory=list)  # the head, left as built (--reset-head)
    source_arch: str | None = None  # the arch a safetensors header names

    def summary(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "loaded": len(self.loaded),
            "missing": self.missing,
            "unexpected": self.unexpected,
            "reset": self.reset,
        }

    def line(self) -> str:
        of_arch = f" of {self.source_arch}" if self.source_arch else ""
        parts = [f"--init-from {self.path}: loaded {len(self.loaded)} tensors{of_arch}"]
        for label, names in (
            ("reset (--reset-head)", self.reset),
            ("missing, left as built", self.missing),
            ("unexpected, ignored", self.unexpected),
        ):
            parts.append(f"{label} {len(names)}{': ' + listed(names) if names else ''}")
        return " · ".join(parts) + "; step, optimiser and schedule start fresh"


def listed(names: list[str]) -> str:
    more = len(names) - SHOWN_NAMES
    return ", ".join(names[:SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")


def head_keys(model: nn.Module, num_classes: int) -> list[str]:
    """The final classifier's own tensors: those of the last module whose weight has one
    row per class (fc, classifier.1, heads.head, a 1x1 conv head alike)."""
    head_name, head = None, None
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim >= 2 and weight.shape[0] == num_classes:
            head_name, head = name, module
    if head is None:
        return []
    prefix = f"{head_name}." if head_name else ""
    return [prefix + key for key in head.state_dict(keep_vars=True) if "." not in key]


def fit_initial_weights(
    model: nn.Module, source: dict[str, torch.Tensor], num_classes: int, reset_head: bool,
    path: Path,
) -> InitReport:  # fmt: skip
    """Load the tensors of SOURCE that the model has, or exit 2 saying why they do not fit."""
    state = strip_ddp_prefix(source)
    expected = model.state_dict()
    head = head_keys(model, num_classes)
    reset = head if reset_head else []
    taken = {key: tensor for key, tensor in state.items() if key not in reset}
    check_shapes(taken, expected, head, path)
    loaded = [key for key in taken if key in expected]
    if not loaded:
        raise usage_error(
            f"invalid --init-from: no tensor name in {path} is one of this model's (the file "
            f"has {listed(list(state))}); check --arch and --model-arg"
        )
    check_finite_weights({key: taken[key] for key in loaded}, path)
    model.load_state_dict({key: taken[key] for key in loaded}, strict=False)
    return InitReport(
        path,
        loaded,
        missing=[key for key in expected if key not in taken and key not in reset],
        unexpected=[key for key in taken if key not in expected],
        reset=reset,
    )


def check_shapes(
    taken: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], head: list[str], path: Path
) -> None:
    differ = [key for key in taken if key in expected and taken[key].shape != expected[key].shape]
    if not differ:
        return
    outside = [key for key in differ if key not in head]
    key = (outside or differ)[0]
    shapes = f"{key} is {list(taken[key].shape)} in the file, {list(expected[key].shape)} here"
    if outside:
        raise usage_error(
            f"invalid --init-from: {path} does not fit this model ({shapes}; {len(outside)} "
            "such tensor(s) outside the classifier); check --arch and --model-arg"
        )
    raise usage_error(
        f"invalid --init-from: {path} was trained for another number of classes ({shapes}); "
        "add --reset-head to start the classifier afresh"
    )


def load_initial_weights(
    model: nn.Module, path: Path, num_classes: int, reset_head: bool, map_location: Any = "cpu"
) -> InitReport:
    try:
        source, metadata = read_initial_weights(path, map_location)
    except DdpcliError as error:
        if error.exit_code != USAGE:  # the device failed (out of memory), not the file
            raise
        raise usage_error(f"invalid --init-from: {error.message}") from None
    if not reset_head:
        check_class_count(metadata, num_classes, path)
    report = fit_initial_weights(model, source, num_classes, reset_head, path)
    report.source_arch = metadata.get("arch")
    return report


def read_initial_weights(path: Path, map_location: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's tensors in PATH, and what its safetensors header says about them (arch,
    classes; nothing for a .pt file, whose tensors speak for themselves)."""
    if is_safetensors_file(path):
        state, metadata = read_safetensors(path)
        return {key: tensor.to(map_location) for key, tensor in state.items()}, metadata
    source = model_state(safe_load(path, map_location=map_location))
    if source is None:
        raise usage_error(
            f"{path} holds no model state dict; give a ddpcli checkpoint, a "
            "`ddpcli checkpoint convert` output or a state dict saved with torch.save"
        )
    return source, {}


def check_class_count(metadata: dict[str, Any], num_classes: int, path: Path) -> None:
    """A header that names other classes than the data set has: say which, before shapes."""
    saved = metadata.get("num_classes")
    if not isinstance(saved, int) or saved == num_classes:
        return
    classes = metadata.get("classes")
    named = f" ({listed([str(name) for name in classes])})" if isinstance(classes, list) else ""
    raise usage_error(
        f"invalid --init-from: {path} was trained on {saved} classes{named}, this data set has "
        f"{num_classes}; add --reset-head to start the classifier afresh"
    )


def check_finite_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """NaN or inf in the weights taken trains nothing, and the run would blame the rate."""
    bad, _ = non_finite_tensors(state.items())
    if bad:
        raise usage_error(
            f"invalid --init-from: {path} holds NaN or inf in {listed_briefly(bad)}; these "
            "weights cannot train, take an earlier checkpoint"
        )
