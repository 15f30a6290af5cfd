"""What every command's configuration shares: value types, list parsing, the GPU-list and
node-rank rules, and pydantic errors rewritten as `invalid --flag: ... (got X)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ValidationError

from ddpcli.errors import usage_error

Backend = Literal["auto", "nccl", "gloo"]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
DatasetName = Literal["synthetic", "stl10", "imagefolder"]


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ValueError(f"{name} takes a comma-separated list of integers, e.g. 0,3") from None


def parse_float_list(text: str, name: str) -> list[float]:
    try:
        return [float(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ValueError(f"{name} takes a comma-separated list of numbers, e.g. 3,5") from None


def from_comma_text(parse: Callable[[str, str], list[Any]], name: str) -> BeforeValidator:
    """A list field that also takes a flag's text form (`0,3`); a recipe gives a list."""
    return BeforeValidator(lambda value: parse(value, name) if isinstance(value, str) else value)


def _valid_gpu_list(value: list[int] | None) -> list[int] | None:
    if value is None:
        return value
    if not value:
        raise ValueError("give at least one GPU index, e.g. --gpus 0,1")
    if any(index < 0 for index in value):
        raise ValueError("GPU indices are 0 or more, as nvidia-smi numbers them")
    if len(set(value)) != len(value):
        raise ValueError(f"each GPU may be listed once (got {value})")
    return value


# `--gpus 0,3`: physical indices as nvidia-smi numbers them, each once.
GpuList = Annotated[
    list[int] | None, from_comma_text(parse_int_list, "gpus"), AfterValidator(_valid_gpu_list)
]


def check_node_rank(node_rank: int, nnodes: int) -> None:
    if node_rank >= nnodes:
        raise ValueError(
            f"invalid --node-rank: {node_rank} must be below --nnodes {nnodes} (0..{nnodes - 1})"
        )


# Fields whose flag is not `--` + the field's name (a repeatable flag names one item).
FLAG_SPELLINGS = {"model_args": "--model-arg"}


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, naming the flag and what is allowed."""
    lines: list[str] = []
    for problem in error.errors():
        field = ".".join(str(part) for part in problem["loc"] if not isinstance(part, int))
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "is not a known setting (see `ddpcli train --help`)"
        message = message.replace("Input should be", "must be")
        if not field:  # a rule across fields: its message names the flags itself
            lines.append(message)
            continue
        flag = FLAG_SPELLINGS.get(field, f"--{field.replace('_', '-')}")
        given = problem.get("input")
        shown = "" if isinstance(given, dict) else f" (got {given!r})"
        lines.append(f"invalid {flag}: {message}{shown}")
    return "\n".join(lines[:2])


Model = TypeVar("Model", bound=BaseModel)


def validated(model: type[Model], values: dict[str, Any]) -> Model:
    """The config, or exit 2 with one line per problem naming the flag."""
    try:
        return model(**values)
    except ValidationError as error:
        raise usage_error(describe_validation_error(error)) from None


def given(flags: dict[str, Any]) -> dict[str, Any]:
    """Flags left at None were not given."""
    return {key: value for key, value in flags.items() if value is not None}
