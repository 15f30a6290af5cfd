"""What `ddpcli eval` measures, decided once in the launching process from the checkpoint
and the flags: the weights, the model, the data and its view, the precision. Every reason
to exit 2 is found here, before any rank starts: a file that is neither a ddpcli
checkpoint nor a plain state dict, a model the file may not or cannot rebuild, weights
that do not fit it, a folder whose classes differ from the checkpoint's.

An import path is code: the file's arch (or data set) is imported only when the user names
it too (`ddpcli.checkpoint.trust.model_to_rebuild` is the one rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddpcli import ui
from ddpcli.checkpoint.loading import (
    check_recorded_digest,
    deployed_state,
    model_state,
    safe_load,
    strip_ddp_prefix,
)
from ddpcli.checkpoint.report import infer_num_classes
from ddpcli.checkpoint.schema import checkpoint_kind
from ddpcli.checkpoint.trust import TRUST_FLAG, model_to_rebuild
from ddpcli.config.data import is_url
from ddpcli.config.eval import EvalConfig
from ddpcli.config.train import holds_shard_index
from ddpcli.data.layout import (
    STL10_SIDE,
    Sample,
    folder_classes,
    folder_samples,
    holds_images,
    listed,
    resize_side,
    stl10_class_names,
    stl10_dir,
)
from ddpcli.data.shards.index import SplitIndex, read_index
from ddpcli.errors import usage_error
from ddpcli.factories import is_factory_spec
from ddpcli.launcher.resolve import check_writable_folder

# The side each data set is trained at when the file does not say (launcher.resolve's).
NATIVE_IMAGE_SIZE = {"synthetic": 32, "stl10": STL10_SIDE}
FOLDER_IMAGE_SIZE = 224
RESULT_FILE = "result.json"  # rank 0's report, in the launch's private folder
# What `checkpoint convert` writes for other runtimes, which eval does not run.
EXPORTED_GRAPHS = {".onnx": "an ONNX model", ".pt2": "a torch.export program"}


@dataclass
class EvalPlan:
    """Plain data (it travels to the ranks as JSON): everything a rank needs to rebuild the
    model and its view of the data, with the reasons the report states."""

    checkpoint: str
    weights: str  # "ema" or "raw"
    weights_reason: str
    arch: str
    model_args: dict[str, Any]
    num_classes: int
    classes: list[str]
    dataset: str
    data_dir: str | None
    split: str
    image_size: int
    val_resize_size: int
    crop_size: int
    precision: str  # as the run had it ("auto" is resolved in each rank, on its device)
    precision_reason: str
    per_gpu_batch: int
    workers: int | None
    normalization: dict[str, list[float]] | None
    seed: int
    synthetic_size: int
    out: str
    predictions: bool
    # The run's own figures for these weights when the file was saved, to compare with.
    run_figures: dict[str, Any] = field(default_factory=dict)


def make_plan(cfg: EvalConfig) -> EvalPlan:
    """The plan for CFG, or exit 2 with the one line that says what does not fit."""
    payload = read_checkpoint(cfg.checkpoint)
    config = payload.get("config")
    saved: dict[str, Any] = config if isinstance(config, dict) else {}
    check_writable_folder(cfg.resolved_out, "--out")
    weights, reason, state = chosen_weights(payload, cfg)
    dataset = chosen_dataset(cfg, saved)
    data_dir = cfg.data_dir or saved_location(saved.get("data_dir"))
    classes = checked_classes(payload, dataset, data_dir, cfg.split)
    choice = model_to_rebuild(saved, cfg.arch, cfg.trust_checkpoint_code)
    if choice.arch is None:
        raise usage_error(f"cannot rebuild the model of {cfg.checkpoint}: {choice.reason}")
    where = data_words(dataset, data_dir, cfg.split)
    check_weights_fit(state, choice.arch, choice.model_args, classes, cfg.checkpoint, where)
    image_size, resize, crop = view_sizes(cfg, saved, dataset)
    precision, precision_reason = chosen_precision(cfg, saved)
    plan_view = {
        "dataset": dataset, "data_dir": resolved(data_dir), "split": cfg.split,
        "image_size": image_size, "val_resize_size": resize, "val_crop_size": crop,
        "precision": precision,
    }  # fmt: skip
    return EvalPlan(
        checkpoint=str(cfg.checkpoint),
        weights=weights,
        weights_reason=reason,
        arch=choice.arch,
        model_args=choice.model_args,
        num_classes=len(classes),
        classes=classes,
        dataset=dataset,
        data_dir=str(data_dir) if data_dir else None,
        split=cfg.split,
        image_size=image_size,
        val_resize_size=resize,
        crop_size=crop,
        precision=precision,
        precision_reason=precision_reason,
        per_gpu_batch=cfg.per_gpu_batch or int(saved.get("per_gpu_batch") or 64),
        workers=cfg.workers,
        normalization=payload.get("normalization"),
        seed=int(saved.get("seed") or 0),
        synthetic_size=int(saved.get("synthetic_size") or 4096),
        out=str(cfg.resolved_out),
        predictions=cfg.predictions,
        run_figures=run_figures(payload, weights) if as_the_run_validated(plan_view, saved) else {},
    )


# --- The file --------------------------------------------------------------------------


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint as a ddpcli payload: a plain state dict becomes {"model": state}, a
    safetensors file its tensors and the metadata its header records. Structure only
    (memory-mapped); exit 2 for a file that is neither."""
    if path.suffix == ".safetensors":
        return safetensors_payload(path)
    check_not_an_export(path)
    payload = safe_load(path, lazy=True)
    check_recorded_digest(path)
    kind = checkpoint_kind(payload)
    if kind == "unknown":
        held = ", ".join(map(str, list(payload)[:5])) if isinstance(payload, dict) else ""
        raise usage_error(
            f"{path} is not a ddpcli checkpoint or a plain state dict"
            + (f" (it holds {held})" if held else f" (it holds a {type(payload).__name__})")
            + "; give a checkpoint `ddpcli train` saved, or a model's state_dict()"
        )
    if kind == "state-dict" and not (isinstance(payload, dict) and "model" in payload):
        return {"model": model_state(payload)}
    return payload


def check_not_an_export(path: Path) -> None:
    """`checkpoint convert`'s graphs are for other runtimes: eval reads weights, and says so
    rather than calling the file corrupt."""
    kind = EXPORTED_GRAPHS.get(path.suffix.lower())
    if kind is not None and path.is_file():
        raise usage_error(
            f"{path} is {kind} (`checkpoint convert --to {path.suffix.lower()[1:]}`); eval reads "
            "a ddpcli checkpoint (.pt), a plain state dict or a .safetensors file: give the "
            "checkpoint it was exported from, or convert that --to safetensors"
        )


def safetensors_payload(path: Path) -> dict[str, Any]:
    from ddpcli.checkpoint.safetensors_io import read_safetensors

    state, metadata = read_safetensors(path)
    config = {
        key: metadata[key]
        for key in (
            "arch",
            "model_args",
            "image_size",
            "val_resize_size",
            "val_crop_size",
            "dataset",
            "precision",
            "per_gpu_batch",
            "seed",
        )  # fmt: skip
        if key in metadata
    }
    normalization = None
    if "mean" in metadata and "std" in metadata:
        normalization = {"mean": metadata["mean"], "std": metadata["std"]}
    return {
        "model": state,
        "config": config,
        "classes": metadata.get("classes"),
        "num_classes": metadata.get("num_classes"),
        "normalization": normalization,
        "only_weights": metadata.get("weights"),  # which ones `convert` kept: "ema" or "raw"
    }


def chosen_weights(
    payload: dict[str, Any], cfg: EvalConfig
) -> tuple[str, str, dict[str, torch.Tensor]]:
    """("ema" or "raw", why, the state dict): the EMA's when the file has it, unless
    --weights raw (`deployed_state`, as `checkpoint convert` picks them); --weights ema on
    a file without it is exit 2."""
    only = payload.get("only_weights")
    if only is not None:  # an exported file holds one set of weights, named in its header
        if cfg.weights not in (None, only):
            raise usage_error(
                f"invalid --weights {cfg.weights}: {cfg.checkpoint} holds the {only} weights "
                "only; export the others with `ddpcli checkpoint convert --weights`"
            )
        return str(only), "the ones the file holds", payload["model"]
    state, which = deployed_state(payload, cfg.weights)
    if state is None:  # read_checkpoint let through only files that hold one
        raise usage_error(f"{cfg.checkpoint} holds no model state dict")
    if cfg.weights is not None:
        why = f"as asked with --weights {cfg.weights}"
    elif which == "ema":
        why = "the file has them; --weights raw for the raw"
    else:
        why = "the file has no EMA"
    return which, why, strip_ddp_prefix(state)


def as_the_run_validated(view: dict[str, Any], saved: dict[str, Any]) -> bool:
    """The same data, split and view as the run's validation: its figure is comparable."""
    run_view = {**{key: saved.get(key) for key in view}, "split": "val"}
    run_view["data_dir"] = resolved(Path(saved["data_dir"]) if saved.get("data_dir") else None)
    return view == run_view


def resolved(location: Path | str | None) -> str | None:
    if isinstance(location, Path):
        return str(location.resolve())
    return location


def run_figures(payload: dict[str, Any], weights: str) -> dict[str, Any]:
    """The run's own validation of these weights in the file's last metrics row."""
    metrics = payload.get("metrics")
    if not isinstance(metrics, list) or not metrics or not isinstance(metrics[-1], dict):
        return {}
    row = metrics[-1]
    prefix = "ema_" if weights == "ema" else ""
    accuracy, loss = row.get(f"{prefix}val_acc"), row.get(f"{prefix}val_loss")
    if accuracy is None:
        return {}
    return {"epoch": row.get("epoch"), "val_acc": accuracy, "val_loss": loss}


# --- The model -------------------------------------------------------------------------


def check_weights_fit(
    state: dict[str, torch.Tensor],
    arch: str,
    model_args: dict[str, Any],
    classes: list[str],
    path: Path,
    where: str,
) -> None:
    """Exit 2 naming the first key that differs: missing, unexpected, or of another shape.
    Weights that fit the model at their own classifier's width are of other classes than
    the data's (a plain state dict does not name its classes): that is said, not --arch."""
    problem = weights_mismatch(state, arch, model_args, len(classes))
    if not problem:
        return
    trained_on = infer_num_classes(state) or len(classes)
    if trained_on != len(classes) and not weights_mismatch(state, arch, model_args, trained_on):
        raise usage_error(
            f"the classes of {where} differ from the weights of {path}: it has "
            f"{len(classes)} classes ({listed(classes)}), the weights' classifier "
            f"{trained_on}; evaluate on data of the classes they were trained on"
        )
    raise usage_error(
        f"the weights of {path} do not fit --arch {arch} with {len(classes)} classes: "
        f"{problem}; name the architecture it was trained with (--arch)"
    )


def weights_mismatch(
    state: dict[str, torch.Tensor], arch: str, model_args: dict[str, Any], num_classes: int
) -> str | None:
    from ddpcli.models.build import build_model

    with torch.device("meta"):  # shapes only: nothing allocated, however large the model
        expected = build_model(arch, num_classes, model_args).state_dict()
    return first_mismatch(expected, state)


def first_mismatch(expected: dict[str, Any], state: dict[str, torch.Tensor]) -> str | None:
    for key, tensor in state.items():
        if key in expected and tuple(tensor.shape) != tuple(expected[key].shape):
            return (
                f"{key} is {list(tensor.shape)} in the file, the model's is "
                f"{list(expected[key].shape)}"
            )
    missing = [key for key in expected if key not in state]
    if missing:
        return f"the file lacks {missing[0]}" + (
            f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        )
    unexpected = [key for key in state if key not in expected]
    if unexpected:
        return f"the model has no {unexpected[0]}" + (
            f" (and {len(unexpected) - 1} more keys)" if len(unexpected) > 1 else ""
        )
    return None


# --- The data and its classes ----------------------------------------------------------


def chosen_dataset(cfg: EvalConfig, saved: dict[str, Any]) -> str:
    """--dataset, else the run's; a folder given with no data set named is an image folder.
    The run's own factory is user code: imported only when named again."""
    if cfg.dataset:
        dataset = cfg.dataset
    elif cfg.data_dir is not None and holds_shard_index(cfg.data_dir):
        dataset = "shards"
    elif cfg.data_dir is not None and saved.get("dataset") in (None, "synthetic"):
        dataset = "imagefolder"
    else:
        dataset = str(saved.get("dataset") or "imagefolder")
    if is_factory_spec(dataset) and not cfg.dataset and not cfg.trust_checkpoint_code:
        raise usage_error(
            f"the file's data set is the import path {dataset}, code that is not run on its "
            f"say; pass --dataset {dataset} if you trust it (or {TRUST_FLAG})"
        )
    if (
        dataset in ("stl10", "imagefolder", "shards")
        and cfg.data_dir is None
        and not saved.get("data_dir")
    ):
        raise usage_error(f"invalid --data-dir: --dataset {dataset} needs --data-dir DIR")
    return dataset


def folder_of_split(data_dir: Path, split: str) -> Path:
    """DIR/SPLIT, or DIR itself when it holds class folders and no split folders."""
    split_dir = data_dir / split
    if split_dir.is_dir():
        return split_dir
    if not data_dir.is_dir():
        raise usage_error(f"invalid --data-dir: {data_dir} is not a folder")
    if not any((data_dir / name).is_dir() for name in ("train", "val", "test")):
        return data_dir
    raise usage_error(
        f"invalid --split: {data_dir} has no {split}/ folder; pick a split it has (--split)"
    )


def samples_of(split_dir: Path, classes: list[str]) -> list[Sample]:
    """The folder's images labelled by the checkpoint's class order (by name)."""
    return folder_samples(split_dir, classes)


def data_classes(dataset: str, data_dir: Path | str | None, split: str) -> list[str] | None:
    """The class names the data holds, where they are known without reading it."""
    if dataset == "shards" and data_dir is not None:
        return shard_split(data_dir, split).classes
    if isinstance(data_dir, str):
        raise usage_error(
            f"invalid --data-dir: {data_dir} is a URL, and only packed shards are read from "
            "one (--dataset shards)"
        )
    if dataset == "imagefolder" and data_dir is not None:
        split_dir = folder_of_split(data_dir, split)
        names = [name for name in folder_classes(split_dir) if holds_images(split_dir / name)]
        if not names:
            raise usage_error(f"{split_dir} holds no class folder with images in it")
        return names
    if dataset == "stl10" and data_dir is not None and stl10_dir(data_dir).is_dir():
        return stl10_class_names(stl10_dir(data_dir))
    if dataset == "synthetic":
        return None  # the synthetic set names its classes as training did: class0..
    return None


def saved_location(saved: Any) -> Path | str | None:
    """The run's --data-dir as config.json holds it: a folder, or a URL kept as text."""
    if not saved:
        return None
    return str(saved) if is_url(str(saved)) else Path(str(saved))


def shard_split(data_dir: Path | str, split: str) -> SplitIndex:
    """The packed split eval reads: `val` for --split val or test (packing keeps a folder's
    held-out images as val), else `train`; exit 2 when the index has none."""
    name = "train" if split == "train" else "val"
    index = read_index(data_dir)
    if name not in index.splits or not index.splits[name].shards:
        raise usage_error(
            f"invalid --split: the shards in {data_dir} hold no {name} split; pick one they "
            f"have ({', '.join(sorted(index.splits))})"
        )
    return index.splits[name]


def checked_classes(
    payload: dict[str, Any], dataset: str, data_dir: Path | str | None, split: str
) -> list[str]:
    """The checkpoint's class names in label order, checked against the data's: a class the
    data has and the checkpoint does not is exit 2, naming it. A class the data lacks is
    only said (it is counted with no support)."""
    saved = payload.get("classes")
    known = [str(name) for name in saved] if isinstance(saved, list) and saved else None
    count = payload.get("num_classes")
    found = data_classes(dataset, data_dir, split)
    where = data_words(dataset, data_dir, split)
    if known is None:
        if found is None:
            return [f"class{index}" for index in range(int(count or 10))]
        if isinstance(count, int) and count != len(found):
            raise usage_error(
                f"the classes of {where} differ from the checkpoint's: {len(found)} class "
                f"folders ({listed(found)}), the checkpoint's model has {count} classes"
            )
        return found
    if found is None:
        return known
    extra = [name for name in found if name not in known]
    if extra:
        raise usage_error(
            f"the classes of {where} differ from the checkpoint's: {listed(extra)} "
            f"{'is' if len(extra) == 1 else 'are'} not among its {len(known)} "
            f"({listed(known)}); evaluate on a folder of the classes it was trained on"
        )
    if dataset in ("imagefolder", "shards"):
        absent = [name for name in known if name not in found]
        if absent:
            ui.warn(
                f"{where} has no images of {len(absent)} of the checkpoint's classes "
                f"({listed(absent)}): they are counted with no support"
            )
    return known


def data_words(dataset: str, data_dir: Path | str | None, split: str) -> str:
    """The data measured, as a message names it: the split's folder, shards, or the set."""
    if dataset == "shards":
        return f"the {split} split of {data_dir}"
    if dataset == "imagefolder" and isinstance(data_dir, Path):
        return str(folder_of_split(data_dir, split))
    return dataset


def view_sizes(cfg: EvalConfig, saved: dict[str, Any], dataset: str) -> tuple[int, int, int]:
    """(image size, val resize, val crop): the run's unless the flags say otherwise; a new
    --image-size or --val-crop-size brings its own resize, as training derives it."""
    native = NATIVE_IMAGE_SIZE.get(dataset, FOLDER_IMAGE_SIZE)
    image_size = cfg.image_size or int(saved.get("image_size") or native)
    sizes_given = cfg.image_size is not None or cfg.val_crop_size is not None
    crop = cfg.val_crop_size or (cfg.image_size or saved.get("val_crop_size") or image_size)
    default_resize = resize_side(crop) if dataset in ("imagefolder", "shards") else crop
    if cfg.val_resize_size:
        resize = cfg.val_resize_size
    elif not sizes_given and saved.get("val_resize_size"):
        resize = int(saved["val_resize_size"])
    else:
        resize = default_resize
    if crop > resize:
        raise usage_error(
            f"invalid --val-crop-size: {crop} is larger than --val-resize-size {resize}; the "
            "crop is cut from the resized image"
        )
    return image_size, resize, int(crop)


def chosen_precision(cfg: EvalConfig, saved: dict[str, Any]) -> tuple[str, str]:
    if cfg.precision is not None:
        return cfg.precision, "as asked with --precision"
    if saved.get("precision"):
        return str(saved["precision"]), "the run's; --precision to change it"
    return "fp32", "the file does not say; fp32"
