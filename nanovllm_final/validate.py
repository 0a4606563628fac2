"""Every value checked where it enters, said once.

An option's help and what it takes live in its dataclass field (`option(...)`); a `Checked`
dataclass checks every assignment against them, so EngineConfig and SamplingParams refuse
a bad value when it is set, the command-line flags are generated from the same fields
(engine_flags.py), and `options(cls)` lists them for the server's schema. What depends on
the model (the vocabulary, max_model_len) is checked per request by `validate_request`
(engine/front_end.py), which the LLM, the engine's request API and the server all ask; the
server maps a `Problem` to an OpenAI error (HTTP 400 with `param` and `code`)."""

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

INT32_MAX, INT64_MIN, INT64_MAX = 2**31 - 1, -(2**63), 2**63 - 1
_NAMES = {INT32_MAX: "2**31-1", INT64_MIN: "-2**63", INT64_MAX: "2**63-1"}


class Problem(ValueError):
    """A value that cannot be served. `param` names the field (an OpenAI error's `param`),
    `code` is the OpenAI error code, `message` says what is wrong and what would do."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float (a bool is not a number, nor is a string of digits)."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bound(value) -> str:
    return _NAMES.get(
        value,
        f"{value:g}".replace("e+0", "e").replace("e-0", "e-")
        if isinstance(value, float)
        else str(value),
    )


@dataclass(frozen=True)
class Spec:
    """What a field takes. `kind`: int, float (ints too), bool, str or list (of `items`:
    int or str); None: anything `convert` accepts. `low`..`high` bound numbers and list
    items (`low_open`: low itself excluded); `optional`: None is allowed too."""

    kind: type | None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    optional: bool = False
    items: type | None = None
    choices: tuple = ()
    pattern: str | None = None  # a str must match it whole
    convert: Callable[[Any], Any] | None = (
        None  # normalizes a value before the check (ValueError: refused)
    )
    rule: str = ""  # says what the value must be, instead of the generated text

    def _in_range(self, value) -> bool:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return low_ok and (self.high is None or value <= self.high)

    def _one(self, kind: type, value) -> bool:
        if kind is int:
            return is_int(value) and self._in_range(value)
        if kind is float:
            return is_number(value) and self._in_range(value)
        if kind is bool:
            return isinstance(value, bool)
        if kind is str:
            return (
                isinstance(value, str)
                and bool(value)
                and (not self.choices or value in self.choices)
                and (self.pattern is None or re.fullmatch(self.pattern, value) is not None)
            )
        return True

    def accepts(self, value) -> bool:
        if value is None:
            return self.optional
        if self.kind is list:
            return isinstance(value, list) and all(self._one(self.items, v) for v in value)
        return self._one(self.kind, value)

    def describe(self) -> str:
        """What the value must be, in words."""
        list_of = self.kind is list
        kind = self.items if list_of else self.kind
        noun = {int: "integer", float: "finite number", str: "non-empty string"}.get(kind, "value")
        if self.rule:
            text = self.rule
        elif kind is bool:
            text = "True or False"
        elif self.choices:
            text = "one of " + ", ".join(map(repr, self.choices))
        else:
            text = (
                f"a list of {noun}s" if list_of else ("an " if noun[0] in "aeiou" else "a ") + noun
            )
            if kind is int and not list_of and self.low == 1 and self.high is not None:
                text = f"a positive integer (at most {_bound(self.high)})"
            elif self.low is not None and self.high is not None:
                text += (
                    f" in {'(' if self.low_open else '['}{_bound(self.low)}, {_bound(self.high)}]"
                )
            elif self.low is not None:
                text += f" {'>' if self.low_open else '>='} {_bound(self.low)}"
        return text + (" or None" if self.optional else "")

    def check(self, name: str, value):
        """The value to store, or a Problem naming the field."""
        given = value
        if self.convert is not None:
            try:
                value = self.convert(value)
            except ValueError as err:
                if isinstance(err, Problem) and (err.param or "").startswith(
                    name
                ):  # names a part of the value already
                    raise err from None
                raise Problem(f"{name}: {err}", name) from None
        if not self.accepts(value):
            raise Problem(f"{name} must be {self.describe()}, got {show(given)}", name)
        return value


def option(default, help: str, kind: type | None = None, **spec) -> Any:
    """A dataclass field with its help and what it takes (Spec's keywords); None as the default
    makes it optional."""
    kind = type(default) if kind is None and default is not None else kind
    spec.setdefault("optional", default is None)
    return field(default=default, metadata={"help": help, "spec": Spec(kind, **spec)})


@functools.cache
def specs(cls: type) -> dict[str, Spec]:
    return {f.name: f.metadata["spec"] for f in fields(cls) if "spec" in f.metadata}


class Checked:
    """A dataclass whose every assignment is checked against its fields' Spec."""

    def __setattr__(self, name: str, value) -> None:
        spec = specs(type(self)).get(name)
        object.__setattr__(self, name, value if spec is None else spec.check(name, value))


@dataclass(frozen=True)
class Option:
    """One option as the command line and the server's schema show it."""

    name: str
    help: str
    default: Any
    annotation: Any  # the field's type, e.g. `float | None`
    spec: Spec


def options(cls: type) -> list[Option]:
    """The options of a Checked dataclass (SamplingParams, EngineConfig) with their help and type."""
    return [
        Option(f.name, f.metadata["help"], f.default, f.type, f.metadata["spec"])
        for f in fields(cls)
        if "spec" in f.metadata
    ]
