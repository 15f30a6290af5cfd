"""Your own code as a flag's value: `pkg.module:factory`, `pkg.module.factory` or
`path/to/file.py:factory` names a callable that `--arch` and `--dataset` call.

Imported as torchrun imports a script's modules: the current directory comes first on
sys.path, in the launcher and in every worker alike. Every way the import can fail
becomes one line and exit 2 naming the flag. No torch here: specs are parsed on the help
path too.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpcli.errors import first_line, usage_error

TIMM_PREFIX = "timm:"
TIMM_INSTALL_HINT = "pip install 'ddpcli[timm]' (or pip install timm)"


@dataclass(frozen=True)
class FactorySpec:
    """Where a factory lives: a module name or a .py file, and the attribute in it."""

    source: str  # `pkg.module`, or a file path ending in .py
    attribute: str

    @property
    def is_file(self) -> bool:
        return self.source.endswith(".py")


def is_factory_spec(text: str) -> bool:
    """`pkg.module:factory`, `pkg.module.factory` or `file.py:factory`: not a plain name
    (resnet18, smallcnn, stl10) and not `timm:NAME`."""
    return not text.startswith(TIMM_PREFIX) and (":" in text or "." in text)


def timm_model_name(text: str) -> str | None:
    """NAME of `--arch timm:NAME`, else None."""
    return text.removeprefix(TIMM_PREFIX) if text.startswith(TIMM_PREFIX) else None


def parse_factory_spec(text: str, flag: str) -> FactorySpec:
    example = f"{flag} pkg.module:factory, pkg.module.factory or path/to/file.py:factory"
    if ":" in text:
        source, _, attribute = text.rpartition(":")
    else:
        source, _, attribute = text.rpartition(".")
    if not source or not attribute.isidentifier():
        raise usage_error(f"invalid {flag}: {text!r} names no callable; use {example}")
    return FactorySpec(source, attribute)


def ensure_cwd_importable() -> None:
    """`python -m` puts the current directory first on sys.path, a console script does not:
    a user's package beside them must import either way (as it does for torchrun)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def import_source(spec: FactorySpec, flag: str) -> Any:
    """The module holding the factory; import errors are the user's code's: one line."""
    ensure_cwd_importable()
    if spec.is_file:
        path = Path(spec.source)
        if not path.is_file():
            raise usage_error(f"invalid {flag}: {path} does not exist (relative to {os.getcwd()})")
        name = f"ddpcli_user_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path.resolve())
        if module_spec is None or module_spec.loader is None:
            raise usage_error(f"invalid {flag}: {path} cannot be imported as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as error:
            del sys.modules[name]
            raise _import_failed(flag, str(path), error) from None
        return module
    try:
        return importlib.import_module(spec.source)
    except ModuleNotFoundError as error:
        raise usage_error(
            f"invalid {flag}: no module {error.name!r} (importing {spec.source}); run from the "
            "folder that holds it, or install it (pip install -e .)"
        ) from None
    except (Exception, SystemExit) as error:
        raise _import_failed(flag, spec.source, error) from None


def _import_failed(flag: str, source: str, error: BaseException) -> Exception:
    return usage_error(
        f"invalid {flag}: importing {source} failed: {type(error).__name__}: {first_line(error)}"
    )


def load_factory(text: str, flag: str) -> Callable[..., Any]:
    """The callable TEXT names, imported now."""
    spec = parse_factory_spec(text, flag)
    module = import_source(spec, flag)
    factory = getattr(module, spec.attribute, None)
    if factory is None:
        raise usage_error(
            f"invalid {flag}: {spec.source} has no attribute {spec.attribute!r}; check the name "
            "after the colon"
        )
    if not callable(factory):
        raise usage_error(
            f"invalid {flag}: {spec.source}:{spec.attribute} is of type "
            f"{type(factory).__name__}, not a callable"
        )
    return factory


def call_factory(factory: Callable[..., Any], text: str, flag: str, **arguments: Any) -> Any:
    """FACTORY(**ARGUMENTS); whatever it raises is the user's code's: one line, exit 2."""
    given = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    try:
        return factory(**arguments)
    except SystemExit as exit_:  # a script's habit; uncaught, the run ended "successfully"
        raise usage_error(
            f"invalid {flag}: {text}({given}) called sys.exit({exit_.code!r}); a factory must "
            "return, not exit"
        ) from None
    except Exception as error:
        raise usage_error(
            f"invalid {flag}: {text}({given}) raised {type(error).__name__}: {first_line(error)}"
        ) from None


def timm_available() -> bool:
    return importlib.util.find_spec("timm") is not None


def check_timm_installed() -> None:
    if not timm_available():
        raise usage_error(
            f"invalid --arch: timm models need timm, which is not installed; {TIMM_INSTALL_HINT}"
        )
