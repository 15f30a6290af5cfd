"""`ddpcli checkpoint convert`'s configuration: which format, from which weights, checked how."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from ddpcli.config.common import CommandConfig, given, validated

ExportFormat = Literal["pt", "safetensors", "onnx", "pt2"]
# OUT's suffix names the format when --to does not; any other suffix is a plain state dict.
FORMAT_OF_SUFFIX: dict[str, ExportFormat] = {
    ".safetensors": "safetensors",
    ".onnx": "onnx",
    ".pt2": "pt2",
    ".pt": "pt",
    ".pth": "pt",
}
# fp32 logits of the exported graph against eager PyTorch on the same inputs: the exporters
# reorder and fuse operations, which moves a float by rounding; times the largest logit's
# size where that is above 1 (rounding is relative).
DEFAULT_TOLERANCE = 1e-4


class ConvertConfig(CommandConfig):
    """What `ddpcli checkpoint convert` was asked to write. Field names are the flags."""

    path: Path
    out: Path
    to: ExportFormat = "pt"
    strip_ddp_prefix: bool = False
    weights_only: bool = False
    weights: Literal["ema", "raw"] | None = Field(
        None, description="the EMA's averaged weights or the trained ones; None: EMA if saved"
    )
    arch: str | None = None
    trust_checkpoint_code: bool = False
    image_size: int | None = Field(
        None, ge=8, le=4096, description="the exported input's side; None: the file's"
    )
    tolerance: float = Field(DEFAULT_TOLERANCE, ge=0)
    check_batch: int = Field(4, ge=2, le=1024, description="the larger batch of the check")
    overwrite: bool = Field(False, description="replace OUT when it exists")

    @model_validator(mode="after")
    def _consistent(self) -> ConvertConfig:
        implied = FORMAT_OF_SUFFIX.get(self.out.suffix.lower())
        if implied is not None and implied != self.to:
            raise ValueError(
                f"invalid --to: OUT's suffix {self.out.suffix} says {implied}, --to says "
                f"{self.to}; name it {self.out.with_suffix(suffix_of(self.to)).name}, or drop --to"
            )
        if self.weights_only and self.to != "pt":
            raise ValueError(
                "invalid --weights-only: it keeps ddpcli's checkpoint layout (--to pt); "
                f"a {self.to} file holds the weights and their metadata already"
            )
        return self

    @property
    def exported(self) -> bool:
        """A model is rebuilt, exported and checked (onnx, pt2), not only its tensors copied."""
        return self.to in ("onnx", "pt2")


def suffix_of(to: str) -> str:
    return {"pt": ".pt", "safetensors": ".safetensors", "onnx": ".onnx", "pt2": ".pt2"}[to]


def build_convert_config(flags: dict[str, Any]) -> ConvertConfig:
    """--to left out is read from OUT's suffix (model.onnx: onnx), else pt as before."""
    values = given(flags)
    if "to" not in values:
        values["to"] = FORMAT_OF_SUFFIX.get(Path(values["out"]).suffix.lower(), "pt")
    return validated(ConvertConfig, values)
