"""What `ddpcli checkpoint inspect|verify|convert` compute: plain data about a checkpoint,
loaded safely (memory-mapped, weights_only=True). The CLI only shows it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ddpcli.checkpoint.loading import (
    deployed_state,
    has_ddp_prefix,
    iter_tensors,
    listed_briefly,
    model_state,
    non_finite_tensors,
    safe_load,
    state_dict_mismatch,
    strip_ddp_prefix,
    unchecked_digest_reason,
)
from ddpcli.checkpoint.safetensors_io import is_safetensors_file, read_safetensors
from ddpcli.checkpoint.schema import FORMAT, TRAINING_KEYS, checkpoint_kind, weights_only_payload
from ddpcli.checkpoint.trust import model_to_rebuild
from ddpcli.errors import first_line, runtime_error, usage_error
from ddpcli.factories import FactorySpec, is_factory_spec, parse_factory_spec
from ddpcli.files import atomic_save, digest_status, folder_write_problem

BATCHNORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def count_parameters(state: dict[str, torch.Tensor]) -> int:
    """Elements of the state dict minus BatchNorm's running statistics (buffers, not weights)."""
    return sum(
        tensor.numel()
        for key, tensor in state.items()
        if not key.endswith(BATCHNORM_STATISTICS)
    )  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """Everything a person or a script wants to know about a checkpoint, as plain data."""
    path = Path(path)
    if is_safetensors_file(path):
        return inspect_safetensors(path)
    storage_devices: Counter[str] = Counter()

    def record_device(storage: object, location: str) -> object:
        storage_devices[location] += 1  # where it was saved from; loaded onto the CPU here
        return storage

    payload = safe_load(path, map_location=record_device, lazy=True)
    report: dict[str, Any] = {
        "path": str(path),
        "size_bytes": path.stat().st_size,
        "kind": checkpoint_kind(payload),
        "digest": digest_status(path),
        "devices": dict(sorted(storage_devices.items())),
        "tensors": sum(1 for _ in iter_tensors(payload)),
        "contents": sorted(map(str, payload)) if isinstance(payload, dict) else [],
    }
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        report.update(training_summary(payload))
    state = model_state(payload)
    if state is not None:
        report["model"] = describe_state(state)
    return report


def inspect_safetensors(path: Path) -> dict[str, Any]:
    """A safetensors file: its tensors (read on the CPU; the format keeps no device) and
    what its header says of the model, as `checkpoint convert` wrote it."""
    state, header = read_safetensors(path)
    return {
        "path": str(path),
        "size_bytes": path.stat().st_size,
        "kind": "safetensors",
        "digest": digest_status(path),
        "devices": {},
        "tensors": len(state),
        "contents": sorted(header),
        "arch": header.get("arch"),
        "num_classes": header.get("num_classes"),
        "classes": header.get("classes"),
        "model": describe_state(state),
    }


def training_summary(payload: dict[str, Any]) -> dict[str, Any]:
    saved_config, saved_metrics = payload.get("config"), payload.get("metrics")
    config = saved_config if isinstance(saved_config, dict) else {}
    metrics = saved_metrics if isinstance(saved_metrics, list) else []
    return {
        "format": payload.get("format"),
        "epochs_done": payload.get("epoch"),
        "epochs_planned": config.get("epochs"),
        "batch_in_epoch": payload.get("batch_in_epoch", 0),
        "step": payload.get("step"),
        "world_size": payload.get("world_size"),
        "arch": config.get("arch"),
        "num_classes": payload.get("num_classes"),
        "classes": payload.get("classes"),  # None: saved before ddpcli recorded them
        "best_val_acc": payload.get("best_val_acc"),
        "resumable": all(key in payload for key in TRAINING_KEYS),
        "metrics": metrics,
        "config": config,
    }


def describe_state(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    dtypes = Counter(_dtype_name(tensor.dtype) for tensor in state.values())
    return {
        "tensors": len(state),
        "parameters": count_parameters(state),
        "elements": sum(tensor.numel() for tensor in state.values()),
        "bytes": sum(tensor.numel() * tensor.element_size() for tensor in state.values()),
        "dtypes": dict(dtypes.most_common()),
        "ddp_prefix": has_ddp_prefix(state),
        "first_keys": list(state)[:3],
    }


# --- Verifying ---------------------------------------------------------------------------


def verify_checkpoint(
    path: Path, arch: str | None = None, num_classes: int | None = None, trust_code: bool = False
) -> dict[str, Any]:
    """Load safely, then check the digest, that every tensor is finite, and that the model of
    its config accepts the state dict. Each check passes, fails or is skipped, with why. The
    model is rebuilt from the file's config only as `model_to_rebuild` allows: an import
    path there runs nothing unless ARCH names it too or TRUST_CODE is given."""
    path = Path(path)
    if is_safetensors_file(path):  # tensors and a JSON header: nothing to unpickle
        payload, header = read_safetensors(path)
        loaded = "safetensors: tensors and a JSON header, nothing unpickled"
    else:
        payload, header = safe_load(path, lazy=True), None
        loaded = "weights_only=True"
    checks = [
        {"check": "safe load", "status": "pass", "detail": loaded},
        _check_digest(path),
        _check_finite(payload),
        _check_model(payload, arch, num_classes, trust_code, header),
        _check_training_state(payload),
    ]
    return {
        "path": str(path),
        "ok": all(check["status"] != "fail" for check in checks),
        "checks": checks,
    }


def _check_digest(path: Path) -> dict[str, str]:
    """The bytes against the SHA-256 recorded at the save. Without a readable record they
    cannot be checked, and a verification that could not check them does not pass."""
    status = digest_status(path)
    unchecked = unchecked_digest_reason(path, status)
    if unchecked:
        return {"check": "sha256", "status": "fail", "detail": unchecked}
    if status["status"] == "mismatch":
        detail = (
            f"file is {status['sha256'][:16]}…, the save recorded {status['recorded'][:16]}…: "
            "the bytes changed after the save"
        )
        return {"check": "sha256", "status": "fail", "detail": detail}
    return {"check": "sha256", "status": "pass", "detail": status["sha256"]}


def _check_finite(payload: Any) -> dict[str, str]:
    bad, checked = non_finite_tensors(iter_tensors(payload))
    if bad:
        return {"check": "finite", "status": "fail", "detail": listed_briefly(bad)}
    return {"check": "finite", "status": "pass", "detail": f"{checked} float tensors"}


def _check_model(
    payload: Any,
    arch: str | None,
    num_classes: int | None,
    trust_code: bool,
    header: dict[str, Any] | None = None,
) -> dict[str, str]:
    state = model_state(payload)
    if state is None:
        return {"check": "model", "status": "fail", "detail": "no model state dict found"}
    recorded, recorded_classes = recorded_model(payload, header)
    choice = model_to_rebuild(recorded, arch, trust_code)
    if choice.arch is None:
        return {"check": "model", "status": "skip", "detail": choice.reason}
    state = strip_ddp_prefix(state)
    classes = num_classes or recorded_classes or infer_num_classes(state)
    try:
        model = build_model_skeleton(choice.arch, classes, choice.model_args)
    except Exception as error:  # an unknown arch is a verdict on the file, not a crash
        return {"check": "model", "status": "fail", "detail": first_line(error, limit=200)}
    problems = state_dict_mismatch(model, state)
    if problems:
        return {"check": "model", "status": "fail", "detail": "; ".join(problems)}
    arguments = "".join(f", {key}={value!r}" for key, value in choice.model_args.items())
    detail = f"{choice.arch}(num_classes={classes}{arguments}) accepts all {len(state)} tensors"
    return {"check": "model", "status": "pass", "detail": detail}


def recorded_model(payload: Any, header: dict[str, Any] | None) -> tuple[dict[str, Any], Any]:
    """What the file says its model is (arch, model_args) and how many classes it has: a
    ddpcli checkpoint in its config, a safetensors file in its HEADER (as convert, eval and
    --init-from read it), a plain state dict nothing."""
    if header is not None:
        return header, header.get("num_classes")
    saved = training_summary(payload) if isinstance(payload, dict) else {}
    return saved.get("config") or {}, saved.get("num_classes")


def _check_training_state(payload: Any) -> dict[str, str]:
    kind = checkpoint_kind(payload)
    if kind != "training":
        detail = "weights only: loads for inference, cannot resume training"
        detail = detail if kind == "weights-only" else "not a ddpcli training checkpoint"
        return {"check": "resumable", "status": "skip", "detail": detail}
    missing = [key for key in TRAINING_KEYS if key not in payload]
    if missing:
        return {"check": "resumable", "status": "fail", "detail": f"missing {', '.join(missing)}"}
    ranks = len(payload["rng"])
    if ranks != payload["world_size"]:
        detail = f"RNG states for {ranks} ranks, world size {payload['world_size']}"
        return {"check": "resumable", "status": "fail", "detail": detail}
    detail = f"optimizer, scheduler and RNG state of {ranks} rank(s)"
    return {"check": "resumable", "status": "pass", "detail": detail}


def infer_num_classes(state: dict[str, torch.Tensor]) -> int | None:
    """The classifier is the last 2-D weight in a classification net's state dict."""
    for key in reversed(list(state)):
        if key.endswith("weight") and state[key].ndim == 2:
            return state[key].shape[0]
    return None


def build_model_skeleton(
    arch: str, num_classes: int | None, model_args: dict[str, Any] | None = None
) -> torch.nn.Module:
    """The model on the meta device: shapes and names only, no memory, no initialisation."""
    from ddpcli.models.build import build_model

    with torch.device("meta"):
        return build_model(arch, 1000 if num_classes is None else num_classes, model_args)


# --- Converting --------------------------------------------------------------------------


def convert_checkpoint(
    path: Path,
    out: Path,
    strip_prefix: bool = False,
    weights_only: bool = False,
    weights: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """A plain state dict (what `model.load_state_dict` takes), or with `weights_only` our
    checkpoint without optimizer, scheduler and RNG state. Either way on the CPU. WEIGHTS
    picks the EMA's or the trained ones (`deployed_state`: the EMA's when saved)."""
    path, out = Path(path), Path(out)
    check_out_file(path, out, overwrite)
    payload = safe_load(path, lazy=True)
    state, which = deployed_state(payload, weights)
    if state is None:
        raise usage_error(f"{path} holds no model state dict to convert")
    if strip_prefix:
        state = strip_ddp_prefix(state)
    is_ours = isinstance(payload, dict) and payload.get("format") == FORMAT
    keep_metadata = weights_only and is_ours
    document = weights_only_payload(payload, state) if keep_metadata else dict(state)
    try:
        digest = atomic_save(document, out)
    except OSError as error:  # the disk filled, or the folder changed since the check
        raise runtime_error(f"could not write {out}: {error.strerror}") from None
    saved = training_summary(payload) if is_ours else {}
    arch, classes = saved.get("arch"), saved.get("num_classes") or infer_num_classes(state)
    return {
        "path": str(path),
        "out": str(out),
        "layout": "weights-only checkpoint" if keep_metadata else "state dict",
        "weights": which,
        "tensors": len(state),
        "parameters": count_parameters(state),
        "ddp_prefix": has_ddp_prefix(state),
        "arch": arch,
        "num_classes": classes,
        "size_bytes": out.stat().st_size,
        "sha256": digest,
        "load_hint": load_hint(
            arch,
            classes,
            out,
            nested=keep_metadata,
            model_args=saved.get("config", {}).get("model_args"),
        ),
    }


def check_out_file(path: Path, out: Path, overwrite: bool) -> None:
    """OUT is a new file (or --overwrite) other than PATH, in a folder this process can write
    in: else exit 2 naming it. An OUT that exists may be a resumable checkpoint (last.pt
    named by a slip), whose optimizer and RNG state no conversion can give back."""
    if out.resolve() == path.resolve():
        raise usage_error(f"OUT must differ from PATH: converting {path} in place would lose it")
    if out.is_dir():
        raise usage_error(
            f"invalid OUT: {out} is a folder; give a file name, e.g. {out / 'model.pt'}"
        )
    if out.exists() and not overwrite:
        raise usage_error(
            f"invalid OUT: {out} exists and is kept; give another name, or --overwrite to "
            "replace it"
        )
    problem = folder_write_problem(out.parent)
    if problem:
        raise usage_error(f"invalid OUT: cannot write {out}: {problem}")


def load_hint(
    arch: str | None,
    num_classes: int | None,
    out: Path,
    nested: bool,
    model_args: dict[str, Any] | None = None,
    state: str | None = None,
) -> str:
    """The plain-PyTorch line that loads the converted file; STATE, the expression that
    reads its state dict when that is not torch.load (safetensors)."""
    from ddpcli.models.build import BUILTIN_MODELS

    if state is None:
        state = f"torch.load({str(out)!r}, weights_only=True)" + ('["model"]' if nested else "")
    if arch and is_factory_spec(arch):  # the user's own factory: their import, their call
        spec = parse_factory_spec(arch, "--arch")
        keywords = "".join(f", {key}={value!r}" for key, value in (model_args or {}).items())
        model = f"{spec.attribute}(num_classes={num_classes or 'N'}{keywords})"
        return f"{factory_import(spec)}; {model}.load_state_dict({state})"
    elif arch in BUILTIN_MODELS:
        model = f"ddpcli.models.build.build_model({arch!r}, num_classes={num_classes})"
    else:
        model = f"torchvision.models.{arch or 'ARCH'}(num_classes={num_classes or 'N'})"
    return f"{model}.load_state_dict({state})"


def factory_import(spec: FactorySpec) -> str:
    """Python that binds the factory's name: an import of a module, or of a file beside
    the user as a module of its name; any other file is run by path (runpy)."""
    if not spec.is_file:
        return f"from {spec.source} import {spec.attribute}"
    path = Path(spec.source)
    if path.parent == Path(".") and path.stem.isidentifier():
        return f"from {path.stem} import {spec.attribute}"
    return f"import runpy; {spec.attribute} = runpy.run_path({str(path)!r})[{spec.attribute!r}]"
