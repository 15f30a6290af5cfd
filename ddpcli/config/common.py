"""What every command's configuration shares: the base of every config (no unknown setting,
no inf or nan), the kinds a setting may be (marked on its field, the lists read from the
marks), value types, list parsing, the GPU-list and node-rank rules, a recipe's
strict types, and pydantic errors rewritten as `invalid --flag: ... (got X)`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    TypeAdapter,
    ValidationError,
)

from ddpcli.environments.pods import PET_FLAGS, pet_variables
from ddpcli.errors import DdpcliError, usage_error


class CommandConfig(BaseModel):
    """The base of every command's config. A setting it does not know is refused, and so is
    a number that is not finite, in every float field and list: `--lr inf` passes `gt=0`,
    `--timeout inf` every lower bound, and a run would go on with a rate or a wait that
    means nothing."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --- Kinds of setting: marked on the field, every list of them derived -----------------------


class Kind(Enum):
    """What a setting is, besides its type: a field is marked with its kinds in its
    annotation (`node_rank: Annotated[int, PER_NODE] = 0`), and the lists that other parts
    keep (what each node may give its own way, what a resume compares) are read from the
    marks by `settings_of_kind`, never written out by hand."""

    # Each node of a job may give its own (its paths, devices, network); the rest must agree.
    PER_NODE = "per node"
    # The run's arithmetic: a resume with another value cannot reproduce the run.
    CHANGES_RESULT = "changes the result"
    # No flag: a debugging hook or a fact that ddpcli's environment variables give.
    FROM_ENVIRONMENT = "from the environment"
    # No flag of its own: it is part of another flag's value (--nnodes MIN:MAX's MIN).
    PART_OF_ANOTHER_FLAG = "part of another flag"
    # Worked out by the run and recorded in config.json; given, it is refused (`Resolved`).
    RESOLVED = "resolved, never given"


PER_NODE = Kind.PER_NODE
CHANGES_RESULT = Kind.CHANGES_RESULT
FROM_ENVIRONMENT = Kind.FROM_ENVIRONMENT
PART_OF_ANOTHER_FLAG = Kind.PART_OF_ANOTHER_FLAG


@dataclass(frozen=True)
class Resolved:
    """The mark of a Kind.RESOLVED field, with the refusal's reason: given, the setting is
    refused with `NAME is not a setting; WHY`, prefixed with where it was given when
    SAYS_WHERE (a config.json passed as a recipe holds it)."""

    why: str
    says_where: bool = False
    kind = Kind.RESOLVED


def marks_of(model: type[BaseModel], name: str) -> list[Any]:
    """The marks on MODEL's field NAME, wherever in MODEL's bases it is declared: a subclass
    that narrows a field's type (the run's plan: what was None, settled) keeps its kinds."""
    return [
        mark
        for base in model.__mro__
        if issubclass(base, BaseModel) and name in base.model_fields
        for mark in base.model_fields[name].metadata
        if isinstance(mark, (Kind, Resolved))
    ]


def kinds_of(model: type[BaseModel], name: str) -> set[Kind]:
    """The kinds MODEL's field NAME is marked with."""
    return {mark if isinstance(mark, Kind) else mark.kind for mark in marks_of(model, name)}


def settings_of_kind(model: type[BaseModel], kind: Kind) -> tuple[str, ...]:
    """MODEL's fields of KIND, its inherited ones too, in the model's order."""
    return tuple(name for name in model.model_fields if kind in kinds_of(model, name))


def resolved_settings(model: type[BaseModel]) -> dict[str, Resolved]:
    """MODEL's fields that the run resolves and no one may give, with why (the nearest
    class's words, where a subclass marks the field again)."""
    found: dict[str, Resolved] = {}
    for name in model.model_fields:
        marks = [mark for mark in marks_of(model, name) if isinstance(mark, Resolved)]
        if marks:
            found[name] = marks[0]
    return found


def refuse_resolved(
    model: type[BaseModel],
    values: Mapping[str, Any],
    from_recipe: Mapping[str, Any],
    recipe: object | None,
) -> None:
    """Exit 2 when VALUES (flags and RECIPE's FROM_RECIPE) give a setting MODEL resolves.
    The refusals that say where come last: a config.json turned recipe holds several, and
    the bare ones have always been named first."""
    resolved = resolved_settings(model)
    for name in sorted(resolved, key=lambda name: resolved[name].says_where):
        if name not in values:
            continue
        message = f"{name} is not a setting; {resolved[name].why}"
        if resolved[name].says_where:
            where = f"recipe {recipe}" if recipe and name in from_recipe else "the flags"
            message = f"{where}: {message}"
        raise usage_error(message)


def flag_settings(model: type[BaseModel]) -> tuple[str, ...]:
    """MODEL's fields that a flag (or a recipe's line) of their own sets."""
    no_flag = {FROM_ENVIRONMENT, PART_OF_ANOTHER_FLAG, Kind.RESOLVED}
    return tuple(name for name in model.model_fields if not kinds_of(model, name) & no_flag)


Backend = Literal["auto", "nccl", "gloo"]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
DatasetName = Literal["synthetic", "stl10", "imagefolder", "shards"]


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


def describe_validation_error(error: ValidationError, setting: str = "") -> str:
    """One line per problem, naming the flag and what is allowed; SETTING names the field
    of an error that is one field's alone (a TypeAdapter's)."""
    lines: list[str] = []
    for problem in error.errors():
        named = (str(part) for part in problem["loc"] if not isinstance(part, int))
        field = ".".join([setting, *named] if setting else named)
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


def with_origins(error: DdpcliError, origins: Mapping[str, str]) -> DdpcliError:
    """ERROR with, on each line, where every setting it names came from (`invalid --cpu:
    ... (--cpu from recipe r.toml; --gpus from the command line)`)."""
    lines = []
    for line in error.message.splitlines():
        flags = dict.fromkeys(re.findall(r"--([a-z0-9-]+)", line))
        notes = [
            f"--{flag} from {origins[name]}"
            for flag in flags
            if (name := flag.replace("-", "_")) in origins
        ]
        lines.append(f"{line} ({'; '.join(notes)})" if notes else line)
    return DdpcliError("\n".join(lines), error.exit_code)


class Excluded(ValueError):
    """The refusal of two settings that exclude each other: FIRST, the one the message is
    about, and SECOND, the setting that makes it wrong. Raised where the rule is checked (a
    validator, where pydantic keeps it as the problem's cause); where a flag sets one side
    and a recipe the other, the flag wins and the recipe's side is left out
    (ddpcli.config.train.settle_train_request), so this refusal is the rule's only
    statement."""

    def __init__(self, message: str, first: str, second: str) -> None:
        super().__init__(message)
        self.first, self.second = first, second


def exclusion_in(error: ValidationError | Excluded) -> Excluded | None:
    """The exclusion a refusal is, where it is one."""
    if isinstance(error, Excluded):
        return error
    for problem in error.errors():
        cause = problem.get("ctx", {}).get("error")
        if isinstance(cause, Excluded):
            return cause
    return None


Model = TypeVar("Model", bound=BaseModel)


def check_strict_types(
    model: type[BaseModel], settings: dict[str, Any], text_forms: tuple[str, ...] = ()
) -> None:
    """Exit 2 for a recipe's value that fits MODEL only once converted (`epochs = true`,
    `cpu = "yes"`, `lr = "0.1"`), as a flag of the wrong type is: pydantic would take it.
    A whole number for a float field stays (`lr = 1`), and so does the text form of a field
    in TEXT_FORMS, which the model parses itself (`nnodes = "2:4"`)."""
    for name, value in settings.items():
        field = model.model_fields.get(name)
        if field is None or (name in text_forms and isinstance(value, str)):
            continue
        adapter: TypeAdapter[Any] = TypeAdapter(field.rebuild_annotation())
        try:
            # TOML's values are JSON's (less dates), and pydantic's strict mode for JSON
            # converts only a whole number to a float and a string to a path.
            adapter.validate_json(json.dumps(value, default=str), strict=True)
        except ValidationError as error:
            # Other problems (a bound, a choice) are the model's to say, with the rest.
            if any(problem["type"].endswith("_type") for problem in error.errors()):
                raise usage_error(describe_validation_error(error, name)) from None


def validated(model: type[Model], values: dict[str, Any]) -> Model:
    """The config, or exit 2 with one line per problem naming the flag."""
    try:
        return model(**values)
    except ValidationError as error:
        raise usage_error(describe_validation_error(error)) from None


def given(flags: dict[str, Any]) -> dict[str, Any]:
    """Flags left at None were not given."""
    return {key: value for key, value in flags.items() if value is not None}


# --- Nodes: how many, and where they meet ------------------------------------------------

NNODES_FORMAT = re.compile(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?")
DEFAULT_RDZV_PORT = 29400  # torchrun's, for an --rdzv-endpoint given without a port
RdzvBackend = Literal["static", "c10d"]


def split_nnodes(data: Any) -> Any:
    """`--nnodes N` or `MIN:MAX` (torchrun's form; a recipe may write "2:3"): the most nodes
    become `nnodes`, the fewest `min_nnodes`. For a model's `mode="before"` validator."""
    if not isinstance(data, dict) or not isinstance(data.get("nnodes"), str):
        return data
    match = NNODES_FORMAT.fullmatch(data["nnodes"])
    if not match:
        raise ValueError(
            f"invalid --nnodes: give N or MIN:MAX, e.g. 2 or 2:4 (got {data['nnodes']!r})"
        )
    low, high = match.group(1), match.group(2)
    if high is None:
        return {**data, "nnodes": int(low)}
    return {**data, "min_nnodes": int(low), "nnodes": int(high)}


def check_membership(
    min_nnodes: int | None, nnodes: int, backend: RdzvBackend | None, endpoint: str | None
) -> None:
    """The rules across --nnodes MIN:MAX, --rdzv-backend and --rdzv-endpoint."""
    if min_nnodes is not None and not 1 <= min_nnodes <= nnodes:
        raise ValueError(
            f"invalid --nnodes: MIN:MAX needs 1 <= MIN <= MAX (got {min_nnodes}:{nnodes})"
        )
    if backend == "static" and min_nnodes is not None and min_nnodes < nnodes:
        raise ValueError(
            f"invalid --rdzv-backend: static is a fixed world, but --nnodes "
            f"{min_nnodes}:{nnodes} lets it change; use c10d (the default for MIN:MAX)"
        )
    if endpoint is not None and not re.fullmatch(r"[^:\s]+(:\d{1,5})?", endpoint):
        raise ValueError(f"invalid --rdzv-endpoint: give HOST or HOST:PORT (got {endpoint!r})")


def elastic_rendezvous(min_nnodes: int | None, nnodes: int, backend: RdzvBackend | None) -> bool:
    """c10d rendezvous (no node ranks: the nodes that come form the world) when asked for,
    or when --nnodes MIN:MAX lets the world change."""
    return backend == "c10d" or (min_nnodes is not None and min_nnodes < nnodes)


def endpoint_address(
    endpoint: str | None, master_addr: str, master_port: int | None, default_port: int
) -> tuple[str, int]:
    """Where the nodes meet: --rdzv-endpoint, else --master-addr:--master-port."""
    if endpoint:
        host, _, port = endpoint.partition(":")
        return host, int(port) if port else DEFAULT_RDZV_PORT
    return master_addr, master_port or default_port


class Membership:
    """How the nodes of a job meet, read the same way by `train` and `launch` configs (both
    have the fields below; declared for the type checker only, so that pydantic neither
    takes them for fields of their own nor reorders the configs' fields)."""

    if TYPE_CHECKING:
        min_nnodes: int | None
        nnodes: int
        rdzv_backend: RdzvBackend | None
        rdzv_endpoint: str | None
        master_addr: str
        master_port: int | None

    @property
    def elastic(self) -> bool:
        """The nodes meet in a c10d rendezvous, with no --node-rank (`--nnodes MIN:MAX`)."""
        return elastic_rendezvous(self.min_nnodes, self.nnodes, self.rdzv_backend)

    def rendezvous_address(self, default_port: int) -> tuple[str, int]:
        return endpoint_address(
            self.rdzv_endpoint, self.master_addr, self.master_port, default_port
        )


# --- Pods: torchrun's PET_* variables as flag defaults ----------------------------------------

# The fields PET_* variables give defaults to; PET_NPROC_PER_NODE is each command's own.
POD_FIELDS = {
    name: flag[2:].replace("-", "_")
    for name, flag in PET_FLAGS.items()
    if name != "PET_NPROC_PER_NODE"
}


def pod_defaults(
    environ: Mapping[str, str], nproc_settings: Callable[[str], dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """A pod's PET_* variables as {field: value}, and {field: "PET_X=value"} saying where each
    came from; NPROC_SETTINGS turns PET_NPROC_PER_NODE into the command's own fields."""
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name, text in pet_variables(environ).items():
        found = nproc_settings(text) if name == "PET_NPROC_PER_NODE" else {POD_FIELDS[name]: text}
        values.update(found)
        origins.update(dict.fromkeys(found, f"{name}={text}"))
    return values, origins


def nproc_spec(text: str, source: str = "PET_NPROC_PER_NODE") -> str | int:
    """PET_NPROC_PER_NODE (or --nproc-per-node) as torchrun takes it: auto, gpu, cpu or a
    count."""
    value = text.strip().lower()
    if value.isdigit() and int(value) >= 1:
        return int(value)
    if value in ("auto", "gpu", "cpu"):
        return value
    raise usage_error(
        f"invalid {source}: give auto, gpu, cpu or a number of processes (got {text!r})"
    )
