"""How options show in `--help`: a flag as a flag, an option with its real default and, for
a choice, the values it takes.

A command's parameters stay None when a flag is not given, so that a recipe's value can
stand (defaults < recipe < flags, ddpcli.config.train.build_train_config). Help therefore
cannot read the default from the signature: it reads it, and a choice field's Literal
values, from the config model's field, so that each is written once, in the model.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

import typer
from rich.markup import escape
from typer.core import HAS_RICH, TyperCommand, TyperGroup

if TYPE_CHECKING:
    from pydantic import BaseModel
    from typer._click.core import Context
    from typer._click.formatting import HelpFormatter


class App(typer.Typer):
    """typer.Typer whose groups and commands show their flags bare in help."""

    def __init__(self, **settings: Any) -> None:
        settings.setdefault("cls", Group)
        settings.setdefault("rich_markup_mode", "rich")  # help texts are Rich markup
        super().__init__(**settings)

    def command(self, *args: Any, **settings: Any) -> Any:
        settings.setdefault("cls", Command)
        return super().command(*args, **settings)


class ReadableHelp:
    """Help pages with each docstring paragraph on one line and no metavar after flags."""

    help: str | None

    def __init__(self, *args: Any, **settings: Any) -> None:
        super().__init__(*args, **settings)
        self.help = unwrapped(self.help)

    # A mixin: get_params and format_help come from the click class it is mixed into.
    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        show_flags_bare(self.get_params(ctx))  # type: ignore[attr-defined]
        super().format_help(ctx, formatter)  # type: ignore[misc]


class Command(ReadableHelp, TyperCommand):
    pass


class Group(ReadableHelp, TyperGroup):
    pass


def unwrapped(text: str | None) -> str | None:
    """A docstring with each paragraph on one line, for Rich to wrap to the terminal: Typer's
    Rich mode keeps the docstring's own line breaks, which break lines mid-sentence."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(
        paragraph if paragraph.startswith("\b") else " ".join(paragraph.splitlines())
        for paragraph in paragraphs
    )


def show_flags_bare(params) -> None:
    """Typer 0.2x writes `<bool>` after every option that takes no value, `--help` included;
    an empty metavar shows a flag as the flag it is."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


def choices(annotation: Any) -> tuple[str, ...]:
    """The values of the Literal in a field's type, looking through `| None` and `list[...]`."""
    if get_origin(annotation) is Literal:
        return tuple(str(value) for value in get_args(annotation))
    found: dict[str, None] = {}
    for argument in get_args(annotation):
        found.update(dict.fromkeys(choices(argument)))
    return tuple(found)


def choice_metavar(annotation: Any) -> str | None:
    """`[synthetic|stl10|imagefolder]`; `[...],...` for a comma-separated list of them."""
    values = choices(annotation)
    if not values:
        return None
    listed = any(get_origin(argument) is list for argument in (annotation, *get_args(annotation)))
    return f"[{'|'.join(values)}]" + (",..." if listed else "")


def shown(value: Any) -> str:
    """A default as a user would type it: 0.0005 not 5e-04, 300 not 300.0, 0,1 for a list."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(shown(item) for item in value)
    return str(value)


def with_default(help: str | None, default: str | None) -> str | None:
    """Help text ending in `[default: ...]`, dimmed as Typer dims its own.

    Typer's `show_default="words"` would print `[default: (words)]`, so the default is written
    here instead; the parameter itself keeps None, meaning "not given"."""
    if default is None:
        return help
    tail = f"[default: {default}]"
    if HAS_RICH:  # help is Rich markup there: a bare `[default: ...]` would read as a style
        tail = f"[dim]{escape(tail)}[/dim]"
    return f"{help}  {tail}" if help else tail


def option(
    help: str | None = None,
    *,
    default: str | None = None,
    panel: str | None = None,
    metavar: str | None = None,
    decls: tuple[str, ...] = (),
) -> Any:
    """A typer.Option whose help states DEFAULT (words, or a value as a user types it)."""
    return typer.Option(
        *decls, help=with_default(help, default), metavar=metavar, rich_help_panel=panel
    )


def setting(
    model: type[BaseModel],
    name: str,
    help: str | None = None,
    *,
    panel: str | None = None,
    default: str | None = None,
    metavar: str | None = None,
) -> Any:
    """The option for MODEL's field NAME (the parameter must be called NAME, default None).

    Help shows the field's default, or DEFAULT in words where the field's default is None
    because the machine decides it later (`all GPUs, else 2 CPU processes`); a choice field
    shows its values as the metavar. A bool field becomes `--name/--no-name`, so a flag can
    override a recipe's `true` either way, and None still means "not given".
    Without HELP, the field's description (if any) is the help.
    """
    field = model.model_fields[name]
    flag = f"--{name.replace('_', '-')}"
    is_bool = field.annotation is bool
    if default is None:
        value = field.get_default(call_default_factory=True)
        if value is None:
            raise ValueError(
                f"{model.__name__}.{name} defaults to None: say in words what it means"
            )
        default = ("" if value else "no-") + flag[2:] if is_bool else shown(value)
    if help is None and field.description:
        help = field.description[0].upper() + field.description[1:] + "."
    return option(
        help,
        default=default,
        panel=panel,
        metavar=metavar or choice_metavar(field.annotation),
        decls=(f"{flag}/--no-{flag[2:]}",) if is_bool else (),
    )
