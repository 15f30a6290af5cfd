"""`ddpcli checkpoint convert --to safetensors|onnx|pt2`: a checkpoint's model for tools
that are not ddpcli.

- safetensors: the tensors, with what rebuilding and feeding the model takes (arch,
  classes, preprocessing) in the header (`safetensors_io`);
- onnx: the model rebuilt (as `trust` allows), exported by the dynamo exporter with a
  dynamic batch axis, and run in onnxruntime;
- pt2: the same through `torch.export`, loaded back with `torch.export.load`.

An exported graph is checked against eager PyTorch on a batch of 1 and one of N random
inputs before OUT is written: the largest absolute difference of the logits is reported,
and past the tolerance the command fails (exit 1) and OUT is left as it was.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpcli import __version__
from ddpcli.checkpoint.loading import (
    deployed_state,
    safe_load,
    state_dict_mismatch,
    strip_ddp_prefix,
)
from ddpcli.checkpoint.report import (
    check_out_file,
    count_parameters,
    infer_num_classes,
    load_hint,
)
from ddpcli.checkpoint.safetensors_io import (
    EXPORT_INSTALL_HINT,
    METADATA_FORMAT,
    is_safetensors_file,
    read_safetensors,
    write_safetensors,
)
from ddpcli.checkpoint.schema import FORMAT as CHECKPOINT_FORMAT
from ddpcli.checkpoint.trust import model_to_rebuild
from ddpcli.config.convert import ConvertConfig
from ddpcli.data.pipeline import IMAGENET_MEAN, IMAGENET_STD
from ddpcli.errors import first_line, runtime_error, usage_error
from ddpcli.files import _replace_recording_digest, atomic_save, file_sha256, fsync_dir

# What each format needs beyond torch: the dynamo exporter writes ONNX with onnx and
# onnxscript, and the check runs the file in onnxruntime.
NEEDED_MODULES = {"safetensors": ("safetensors",), "onnx": ("onnx", "onnxscript", "onnxruntime")}
DEFAULT_SIDE = 224  # the exported input's side when neither the file nor --image-size says
INPUT_NAME, OUTPUT_NAME = "images", "logits"
ONNX_SIZE_LIMIT = 2**31 - 2**24  # protobuf's 2 GB, less headroom: bigger weights go beside
LAYOUTS = {"pt": "state dict", "safetensors": "safetensors file", "onnx": "ONNX model",
           "pt2": "torch.export program"}  # fmt: skip
# The run's settings that say what the model was fed and how the run measured it: a
# safetensors header keeps them, so that `ddpcli eval` of the file measures as the run did.
FED_SETTINGS = (
    "image_size", "val_resize_size", "val_crop_size", "dataset", "precision", "per_gpu_batch",
    "seed",
)  # fmt: skip


@dataclass
class ModelSource:
    """The weights to export and what is known about them."""

    path: Path
    state: dict[str, torch.Tensor]  # plain keys, on the CPU
    metadata: dict[str, Any]  # the safetensors header's fields (`safetensors_io`)


def check_export_modules(to: str) -> None:
    """Exit 2 naming the extra when a package the format needs is missing."""
    for name in NEEDED_MODULES.get(to, ()):
        try:
            importlib.import_module(name)
        except ImportError:
            raise usage_error(
                f"--to {to} needs the {name} package, which is not installed; {EXPORT_INSTALL_HINT}"
            ) from None


# --- What is exported -----------------------------------------------------------------------


def read_model_source(path: Path, weights: str | None) -> ModelSource:
    """A ddpcli checkpoint, a plain state dict or a safetensors file, with its metadata."""
    if is_safetensors_file(path):
        state, metadata = read_safetensors(path)
        held = metadata.get("weights")
        if weights is not None and held is not None and held != weights:
            raise usage_error(f"invalid --weights {weights}: {path} holds the {held} weights only")
        return ModelSource(path, strip_ddp_prefix(state), metadata)
    payload = safe_load(path)
    found, which = deployed_state(payload, weights)
    if found is None:
        raise usage_error(f"{path} holds no model state dict to convert")
    state = strip_ddp_prefix(found)
    return ModelSource(path, state, checkpoint_metadata(payload, state, which))


def checkpoint_metadata(
    payload: Any, state: dict[str, torch.Tensor], weights: str
) -> dict[str, Any]:
    """What a ddpcli checkpoint says about its model; a plain state dict says only its
    head's width."""
    metadata: dict[str, Any] = {"format": METADATA_FORMAT, "ddpcli_version": __version__}
    if not (isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT):
        return {**metadata, "num_classes": infer_num_classes(state)}
    saved_config = payload.get("config")
    config: dict[str, Any] = saved_config if isinstance(saved_config, dict) else {}
    classes = payload.get("classes")
    metadata.update(
        arch=config.get("arch"),
        model_args=config.get("model_args") or None,
        classes=list(classes) if isinstance(classes, (list, tuple)) else None,
        num_classes=payload.get("num_classes") or infer_num_classes(state),
        weights=weights,
        epoch=payload.get("epoch"),
        step=payload.get("step"),
        best_val_acc=payload.get("best_val_acc"),
        **{key: config.get(key) for key in FED_SETTINGS},
        **normalisation(payload, config),
    )
    return metadata


def normalisation(payload: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The mean and std the inputs were normalised with, as the checkpoint records them;
    older files imply ImageNet's for image folders and the user's sets (the in-memory sets
    measured their own, which those files do not keep)."""
    recorded = payload.get("normalization")
    if isinstance(recorded, dict) and recorded.get("mean") and recorded.get("std"):
        return {"mean": list(recorded["mean"]), "std": list(recorded["std"])}
    if config.get("dataset") in ("synthetic", "stl10"):
        return {}
    return {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}


def rebuild_model(source: ModelSource, arch: str | None, trust_code: bool) -> tuple[nn.Module, str]:
    """The model the weights belong to, in eval mode on the CPU, with them loaded; the arch
    named in the file is built only as `trust.model_to_rebuild` allows."""
    from ddpcli.models.build import build_model

    choice = model_to_rebuild(source.metadata, arch, trust_code)
    if choice.arch is None and not source.metadata.get("arch"):
        raise usage_error(
            f"cannot export {source.path}: it names no architecture; pass --arch NAME, the "
            "model its weights belong to (e.g. --arch resnet18)"
        )
    if choice.arch is None:
        raise usage_error(f"cannot export {source.path}: {choice.reason}")
    classes = source.metadata.get("num_classes") or infer_num_classes(source.state)
    if classes is None:
        raise usage_error(f"cannot export {source.path}: no classifier found to count classes")
    with torch.device("cpu"):
        model = build_model(choice.arch, int(classes), choice.model_args)
    problems = state_dict_mismatch(model, source.state)
    if problems:
        raise usage_error(
            f"cannot export {source.path}: the weights do not fit {choice.arch} "
            f"({'; '.join(problems)}); check --arch"
        )
    model.load_state_dict(source.state)
    return model.float().eval(), choice.arch


# --- Writing -----------------------------------------------------------------------------


def export_checkpoint(cfg: ConvertConfig) -> dict[str, Any]:
    """Write CFG.out in CFG.to's format; exported graphs are checked before OUT appears."""
    check_out_file(cfg.path, cfg.out, cfg.overwrite)
    check_export_modules(cfg.to)
    source = read_model_source(cfg.path, cfg.weights)
    if cfg.arch and cfg.arch != source.metadata.get("arch"):  # the user's word: recorded too
        source.metadata.update(arch=cfg.arch, model_args=None)
    report: dict[str, Any] = {
        "path": str(cfg.path),
        "out": str(cfg.out),
        "to": cfg.to,
        "layout": LAYOUTS[cfg.to],
        "tensors": len(source.state),
        "parameters": count_parameters(source.state),
        "weights": source.metadata.get("weights"),
        "arch": cfg.arch or source.metadata.get("arch"),
        "num_classes": source.metadata.get("num_classes"),
        "classes": source.metadata.get("classes"),
    }
    if cfg.to == "safetensors":
        report["sha256"] = write_safetensors(cfg.out, source.state, source.metadata)
    elif cfg.to == "pt":  # from a safetensors file: the plain state dict torch.load reads
        report["sha256"] = save_state_dict(source.state, cfg.out)
    else:
        report.update(export_graph(cfg, source))
    report["size_bytes"] = cfg.out.stat().st_size
    report["load_hint"] = export_load_hint(cfg, report, source.metadata.get("model_args"))
    return report


def export_load_hint(cfg: ConvertConfig, report: dict[str, Any], model_args: Any) -> str:
    """The line that loads OUT outside ddpcli, for its format."""
    out = str(cfg.out)
    if cfg.to == "onnx":
        side = report["input_shape"][-1]
        return (
            f"onnxruntime.InferenceSession({out!r}).run(None, {{{INPUT_NAME!r}: images}})[0]  "
            f"# images: float32 numpy (N, 3, {side}, {side}), normalised"
        )
    if cfg.to == "pt2":
        return f"torch.export.load({out!r}).module()(images)"
    state = f"safetensors.torch.load_file({out!r})" if cfg.to == "safetensors" else None
    arch, classes = report["arch"], report["num_classes"]
    return load_hint(arch, classes, cfg.out, nested=False, model_args=model_args, state=state)


def save_state_dict(state: dict[str, torch.Tensor], out: Path) -> str:
    try:
        return atomic_save(state, out)
    except OSError as error:  # the disk filled, or the folder changed since the check
        raise runtime_error(f"could not write {out}: {error.strerror}") from None


def export_graph(cfg: ConvertConfig, source: ModelSource) -> dict[str, Any]:
    """ONNX or pt2, written in a scratch folder beside OUT, checked, then renamed into place."""
    model, arch = rebuild_model(source, cfg.arch, cfg.trust_checkpoint_code)
    side = input_side(cfg, source.metadata)
    scratch = Path(tempfile.mkdtemp(prefix=f".{cfg.out.name}.", suffix=".tmp", dir=cfg.out.parent))
    try:
        written = scratch / cfg.out.name
        exporter = write_onnx if cfg.to == "onnx" else write_pt2
        exporter(model, written, side, source.metadata)
        checks = compare_with_eager(model, exported_runner(cfg.to, written), side, cfg.check_batch)
        worst = max(check["max_abs_diff"] for check in checks)
        allowed = cfg.tolerance * max(1.0, *(check["largest_logit"] for check in checks))
        if worst > allowed:
            raise runtime_error(
                f"the {cfg.to} export of {cfg.path} differs from eager PyTorch by {worst:.3g} "
                f"(largest absolute difference of the logits; {differences(checks)}), past the "
                f"tolerance {allowed:.3g}: {cfg.out} not written; try --to "
                f"{'pt2' if cfg.to == 'onnx' else 'onnx'}, or --tolerance if that much is fine"
            )
        digest = move_into_place(scratch, cfg.out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "arch": arch,
        "input_shape": ["batch", 3, side, side],
        "checks": checks,
        "max_abs_diff": worst,
        "tolerance": allowed,
        "sha256": digest,
    }


def input_side(cfg: ConvertConfig, metadata: dict[str, Any]) -> int:
    """The exported input's height and width: --image-size, else the validation crop the
    run measured itself at, else its image size, else 224."""
    for side in (cfg.image_size, metadata.get("val_crop_size"), metadata.get("image_size")):
        if isinstance(side, int) and side > 0:
            return side
    return DEFAULT_SIDE


def example_images(batch: int, side: int, seed: int = 0) -> torch.Tensor:
    """Inputs as normalised images look: zero mean, unit spread."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, side, side, generator=generator)


def write_onnx(model: nn.Module, out: Path, side: int, metadata: dict[str, Any]) -> None:
    """The dynamo exporter, batch axis dynamic; the metadata in the model's properties."""
    from ddpcli.checkpoint.safetensors_io import encode_metadata

    batch = torch.export.Dim("batch", min=1)
    try:
        program = torch.onnx.export(
            model, (example_images(2, side),), dynamo=True, dynamic_shapes=({0: batch},),
            input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], verbose=False,
        )  # fmt: skip
    except Exception as error:  # an op the exporter cannot translate, a graph break
        raise runtime_error(f"the ONNX exporter failed: {first_line(error, 240)}") from None
    if program is None:  # pragma: no cover - only the TorchScript exporter returns None
        raise runtime_error("the ONNX exporter returned no program")
    program.model.metadata_props.update(encode_metadata(metadata))
    weights = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    program.save(str(out), external_data=weights > ONNX_SIZE_LIMIT)


def write_pt2(model: nn.Module, out: Path, side: int, metadata: dict[str, Any]) -> None:
    """torch.export's program, batch axis dynamic; the metadata as an extra file inside."""
    batch = torch.export.Dim("batch", min=1)
    try:
        program = torch.export.export(
            model, (example_images(2, side),), dynamic_shapes=({0: batch},)
        )
    except Exception as error:
        raise runtime_error(f"torch.export failed: {first_line(error, 240)}") from None
    known = {key: value for key, value in metadata.items() if value is not None}
    extra = {"ddpcli_metadata.json": json.dumps(known)}
    torch.export.save(program, str(out), extra_files=extra)


def exported_runner(to: str, file: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """The written file, loaded back as its users will: onnxruntime, or torch.export.load."""
    if to == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        return lambda images: torch.from_numpy(session.run(None, {INPUT_NAME: images.numpy()})[0])
    program = torch.export.load(str(file)).module()
    return lambda images: program(images)


def compare_with_eager(
    model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], side: int, batch: int
) -> list[dict[str, Any]]:
    """The largest absolute difference of the logits, on a batch of 1 and one of BATCH, and
    the largest logit: float32 rounds relative to a value's size, so the tolerance (1e-4 by
    default) is for logits up to 1 and grows with them."""
    checks = []
    with torch.no_grad():
        for size in (1, batch):
            images = example_images(size, side, seed=size)
            expected, got = model(images), run(images)
            if tuple(got.shape) != tuple(expected.shape):
                raise runtime_error(
                    f"the exported model returns shape {tuple(got.shape)} for a batch of {size}, "
                    f"eager PyTorch {tuple(expected.shape)}"
                )
            difference = (got.float() - expected.float()).abs().max().item()
            largest = expected.float().abs().max().item()
            checks.append({"batch": size, "max_abs_diff": difference, "largest_logit": largest})
    return checks


def differences(checks: list[dict[str, Any]]) -> str:
    return ", ".join(f"batch {c['batch']}: {c['max_abs_diff']:.3g}" for c in checks)


def move_into_place(scratch: Path, out: Path) -> str:
    """Every file the exporter wrote (ONNX's external weights too) renamed beside OUT, OUT
    last, with its SHA-256 recorded as for every file ddpcli writes; OUT's digest."""
    for extra in scratch.iterdir():
        if extra.name != out.name:
            os.replace(extra, out.parent / extra.name)
    written = scratch / out.name
    with open(written, "rb") as handle:
        os.fsync(handle.fileno())
    os.chmod(written, 0o644)
    digest = file_sha256(written)
    _replace_recording_digest(written, out, digest)
    fsync_dir(out.parent)
    return digest
