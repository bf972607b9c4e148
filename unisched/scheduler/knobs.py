"""One table of the daemon's knobs: each DaemonConfig field declares its section, range or choices, unit and help
once (`knob(...)`), and the TOML validation, `serve`'s flags and docs/configuration.md are all made from it, so
they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, TypeVar

__all__ = ["Knob", "KnobError", "TableKey", "knob", "knobs_of", "shown"]

T = TypeVar("T")
Section = Literal["daemon", "policy"]
Kind = Literal["str", "float", "int", "bool", "choice"]
_META = "unisched.knob"


class KnobError(ValueError):
    """A value outside a knob's type or range; the message says what is allowed (the caller adds the key)."""


@dataclass(frozen=True)
class Knob:
    """One config key: `[section] name = value` in the file, `--flag` on `serve`."""

    section: Section
    help: str
    unit: str = ""
    bounds: tuple[float, float] | None = None
    """Inclusive range of a number (int bounds for an int knob)."""
    choices: tuple[str, ...] = ()
    flag: str = ""
    """The `serve` flag when it is not --<name> (a bool on by default: --no-<name>)."""
    default_text: str = ""
    """What the default is when it is not the field's value (one derived from another key)."""
    check: Callable[[Any], Any] | None = None
    """Further check after the type and range: returns the value to keep, raises ValueError saying why not."""
    name: str = ""
    default: Any = None

    @property
    def kind(self) -> Kind:
        if self.choices:
            return "choice"
        if isinstance(self.default, bool):
            return "bool"
        if isinstance(self.default, int):
            return "int"
        if isinstance(self.default, float):
            return "float"
        return "str"

    @property
    def flag_name(self) -> str:
        if self.flag:
            return self.flag
        negated = self.kind == "bool" and self.default
        return ("--no-" if negated else "--") + self.name.replace("_", "-")

    def parse(self, value: Any) -> Any:
        """A TOML or flag value -> the field's value; KnobError names what is allowed."""
        kind = self.kind
        if kind == "choice":
            if value not in self.choices:
                raise KnobError(f"must be one of {', '.join(self.choices)}; got {value!r}")
            out: Any = type(self.default)(value) if isinstance(self.default, Enum) else value
        elif kind == "str":
            if not isinstance(value, str) or not value:
                raise KnobError(f"must be a non-empty string; got {value!r}")
            out = value
        elif kind == "bool":
            if not isinstance(value, bool):
                raise KnobError(f"must be true or false; got {value!r}")
            out = value
        else:
            out = self._number(value)
        if self.check is not None:
            try:
                out = self.check(out)
            except ValueError as e:
                raise KnobError(str(e)) from None
        return out

    def _number(self, value: Any) -> float | int:
        lo, hi = self.bounds or (-float("inf"), float("inf"))
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise KnobError(f"must be an integer in {self.range_text}; got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            raise KnobError(f"must be a number in {self.range_text}; got {value!r}")
        return float(value)

    @property
    def range_text(self) -> str:
        """1..10000 for a number, a | b | c for a choice, '' otherwise."""
        if self.choices:
            return " | ".join(self.choices)
        if self.bounds is None:
            return ""
        lo, hi = self.bounds
        return f"{int(lo)}..{int(hi)}" if self.kind == "int" else f"{lo:g}..{hi:g}"

    @property
    def default_shown(self) -> str:
        return self.default_text or shown(self.default)


@dataclass(frozen=True)
class TableKey:
    """A key of an array of tables ([[tenants]], [[tidal]]): what docs/configuration.md says of it, and the loader's
    list of allowed keys."""

    name: str
    type: str
    allowed: str
    default: str
    help: str


def shown(value: Any) -> str:
    """A default as the TOML file would spell it (unset for none)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def knob(default: T, section: Section, help: str, **spec: Any) -> T:
    """A dataclass field that is also a config key (spec: Knob's other fields)."""
    return field(default=default, metadata={_META: Knob(section, help, **spec)})


def knobs_of(cls: type) -> tuple[Knob, ...]:
    """The knobs of a dataclass, in field order, with their names and defaults filled in."""
    out = []
    for f in dataclasses.fields(cls):
        meta: Mapping[str, Any] = f.metadata
        if _META in meta:
            out.append(dataclasses.replace(meta[_META], name=f.name, default=f.default))
    return tuple(out)
