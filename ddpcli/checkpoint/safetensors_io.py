"""safetensors files: a model's tensors plus what rebuilding and feeding it takes (arch,
classes, preprocessing) in the header's string map.

A safetensors file holds only tensors and a JSON header, so reading one runs nothing; the
arch it names is still code to import when it is an import path, and the callers ask
`ddpcli.checkpoint.trust` before building it, as for any checkpoint. The safetensors
package is the `export` extra's, imported only here and only when a file is read or written.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ddpcli.checkpoint.loading import check_is_file
from ddpcli.errors import first_line, runtime_error, usage_error
from ddpcli.files import _replace_recording_digest, fsync_dir

EXPORT_INSTALL_HINT = "pip install 'ddpcli[export]'"
SUFFIX = ".safetensors"
METADATA_FORMAT = "ddpcli-model-v1"  # the header fields below, as this version writes them
# The header's values are strings; these keys hold JSON (numbers, lists, objects) and are
# decoded on reading. Every other key is kept as the string it is (arch, format, version).
JSON_FIELDS = frozenset(
    {
        "classes", "num_classes", "model_args", "image_size", "val_resize_size",
        "val_crop_size", "mean", "std", "epoch", "step", "best_val_acc",
    }
)  # fmt: skip


def import_safetensors(purpose: str) -> Any:
    """The safetensors.torch module, or exit 2 saying which extra brings it."""
    try:
        import safetensors.torch
    except ImportError:
        raise usage_error(
            f"{purpose} needs the safetensors package, which is not installed; "
            f"{EXPORT_INSTALL_HINT}"
        ) from None
    return safetensors.torch


def is_safetensors_file(path: Path) -> bool:
    """By its name: safetensors has no magic bytes, only an 8-byte header length."""
    return Path(path).suffix == SUFFIX


def encode_metadata(metadata: dict[str, Any]) -> dict[str, str]:
    """The header's string map: strings kept, everything else as JSON; None left out."""
    return {
        key: value if isinstance(value, str) and key not in JSON_FIELDS else json.dumps(value)
        for key, value in metadata.items()
        if value is not None
    }


def decode_metadata(header: dict[str, str] | None, path: Path) -> dict[str, Any]:
    """The header's string map back into values; a JSON field that does not parse is exit 2."""
    decoded: dict[str, Any] = {}
    for key, text in (header or {}).items():
        if key not in JSON_FIELDS:
            decoded[key] = text
            continue
        try:
            decoded[key] = json.loads(text)
        except json.JSONDecodeError:
            raise usage_error(
                f"{path}: the header's {key!r} is not JSON ({text[:60]!r}); the file was not "
                "written by `ddpcli checkpoint convert --to safetensors`, or was edited"
            ) from None
    classes = decoded.get("classes")
    if isinstance(classes, list) and "num_classes" not in decoded:
        decoded["num_classes"] = len(classes)
    return decoded


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state dict (on the CPU) and the metadata of a safetensors file: arch, classes
    (list), num_classes, image_size, val_resize_size, val_crop_size, mean, std,
    ddpcli_version, ... as far as the file records them. Bad files are exit 2."""
    path = Path(path)
    library = import_safetensors(f"reading {path}")
    check_is_file(path)
    from safetensors import safe_open

    try:
        state = library.load_file(str(path), device="cpu")
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata()
    except Exception as error:  # SafetensorError, OSError: a truncated or foreign file
        raise usage_error(
            f"checkpoint {path} is not a readable safetensors file ({first_line(error, 160)})"
        ) from None
    return state, decode_metadata(header, path)


def write_safetensors(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, Any]) -> str:
    """Write STATE with METADATA in the header atomically (temporary file, fsync, rename),
    its SHA-256 recorded beside it as for every checkpoint; return the digest."""
    library = import_safetensors(f"writing {path}")
    path = Path(path)
    # safetensors refuses tensors that share memory or are not contiguous: copies here.
    tensors = {key: tensor.detach().cpu().contiguous().clone() for key, tensor in state.items()}
    data = library.save(tensors, metadata=encode_metadata(metadata))
    digest = hashlib.sha256(data).hexdigest()
    try:
        write_recorded(path, data, digest)
    except OSError as error:  # the disk filled, or the folder changed since the check
        raise runtime_error(f"could not write {path}: {error.strerror or error}") from None
    return digest


def write_recorded(path: Path, data: bytes, digest: str) -> None:
    """DATA to PATH through a temporary file, fsync and rename, its digest beside it (the
    rename as `ddpcli.files` does it for every checkpoint, so the sidecar always matches)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; a model file is an ordinary file
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        _replace_recording_digest(tmp_name, path, digest)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
