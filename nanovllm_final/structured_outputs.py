"""What a request's output must match: vLLM's `structured_outputs` (one of json, json_object,
regex, choice, grammar), checked where it enters. The grammar engine (xgrammar, the optional
extra `structured`) compiles it in the engine (engine/structured.py); nothing here needs it."""

import json
from collections.abc import Iterator
from dataclasses import dataclass, fields

MAX_DEPTH = 32  # nesting of a JSON schema: deeper ones take the compiler seconds to minutes
MAX_PROPERTIES = (
    1024  # in a whole schema: 10,000 optional ones take the compiler minutes (1,000: about 0.5 s)
)
# keywords the grammar engine would ignore without a word: refused, so no output breaks a schema silently
UNSUPPORTED = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
        "patternProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "multipleOf",
    }
)
SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keyword -> [schema, ...]
SCHEMA_ONE = ("items", "additionalProperties")  # keyword -> schema (or a bool)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one field set. json: a JSON schema (a dict, or its JSON text); json_object: any
    JSON object; regex: the whole output matches it; choice: the output is one of these strings;
    grammar: an EBNF grammar (xgrammar's GBNF dialect, `root ::= ...`)."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(chosen) != 1:
            names = ", ".join(f.name for f in fields(self))
            raise ValueError(f"set exactly one of {names}; got {', '.join(chosen) or 'none'}")
        kind = chosen[0]
        value = getattr(self, kind)
        if kind == "json":
            object.__setattr__(self, "json", check_schema(value))
        elif kind == "json_object" and value is not True:
            raise ValueError(f"json_object must be True, got {value!r}")
        elif kind == "choice" and (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(
                f"choice must be a non-empty list of non-empty strings, got {value!r:.80}"
            )
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"{kind} must be a non-empty string, got {value!r:.80}")
        if kind == "choice":
            object.__setattr__(self, "choice", list(value))

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar cache is keyed by."""
        value = getattr(self, self.kind)
        return self.kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def json_object(value, rule: str) -> dict:
    """`value` if a dict, parsed if JSON text of an object; else a ValueError saying `rule`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"{rule}; the text is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{rule}, got {type(value).__name__}")
    return value


def check_schema(value: dict | str) -> dict:
    """The schema as a dict, or a ValueError: not JSON, not an object, nested deeper than
    MAX_DEPTH, more than MAX_PROPERTIES properties, or a keyword the grammar engine would ignore."""
    value = json_object(value, "json must be a JSON schema (an object, or its JSON text)")
    num_properties = 0
    for schema, where, depth in subschemas(value):
        num_properties += (
            len(schema["properties"]) if isinstance(schema.get("properties"), dict) else 0
        )
        if num_properties > MAX_PROPERTIES:
            raise ValueError(f"json schema has more than {MAX_PROPERTIES} properties")
        if depth > MAX_DEPTH:
            raise ValueError(
                f"json schema is nested more than {MAX_DEPTH} levels deep (at {where[:120]})"
            )
        bad = sorted(UNSUPPORTED & schema.keys())
        if bad:
            raise ValueError(f"json schema keyword {bad[0]!r} at {where} is not supported")
    return value


def subschemas(schema: dict) -> Iterator[tuple[dict, str, int]]:
    """Every schema in `schema` (itself first) with its path and depth; iterative, so a schema
    nested thousands deep is refused by the caller, not a RecursionError."""
    stack = [(schema, "#", 0)]
    while stack:
        schema, where, depth = stack.pop()
        if not isinstance(schema, dict):
            continue
        yield schema, where, depth
        for key in SCHEMA_MAPS:
            if isinstance(schema.get(key), dict):
                stack += [
                    (sub, f"{where}/{key}/{name}", depth + 1) for name, sub in schema[key].items()
                ]
        for key in SCHEMA_LISTS:
            if isinstance(schema.get(key), list):
                stack += [
                    (sub, f"{where}/{key}/{i}", depth + 1) for i, sub in enumerate(schema[key])
                ]
        stack += [(schema[key], f"{where}/{key}", depth + 1) for key in SCHEMA_ONE if key in schema]


def to_structured(value) -> StructuredOutputsParams | None:
    """SamplingParams' converter: None, a StructuredOutputsParams, or a dict of its fields (or
    that dict's JSON text, as the command line's --structured-outputs gives it)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    value = json_object(
        value, "must be a StructuredOutputsParams or a dict of its fields (or its JSON text)"
    )
    unknown = sorted(set(value) - {f.name for f in fields(StructuredOutputsParams)})
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    return StructuredOutputsParams(**value)
