"""JSON schemas, regexes and choices that structured-output tests and benchmarks share.

Every schema bounds its output (string lengths, integer ranges, array sizes), so that even a
random-weight model reaches the end of the structure in a few dozen tokens."""

NAME = {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": NAME},
        "required": ["name"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"age": SMALL_INT},
        "required": ["age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": SMALL_INT, "y": SMALL_INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"kind": {"const": "story"}, "title": NAME},
        "required": ["kind", "title"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "high"]}},
        "required": ["level", "label"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2},
                },
                "required": ["name", "roles"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": 10, "maximum": 20},
            "pass": {"type": "boolean"},
        },
        "required": ["score", "pass"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [SMALL_INT, {"type": "boolean"}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
        "required": ["maybe"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "items": SMALL_INT, "maxItems": 2},
            }
        },
        "required": ["matrix"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[0-9a-f]{4}$"}, "count": SMALL_INT},
        "required": ["id", "count"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
        "required": ["word"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": SMALL_INT},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": NAME,
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
]

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)",
    r"-?[1-9][0-9]{0,2}",
]
CHOICES = [["apple", "banana", "cherry"], ["positive", "negative"], ["A", "B", "C", "D"]]

# A story with a title and a list of characters: the notebook's and the README's example.
STORY = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "characters": {
            "type": "array",
            "maxItems": 3,
            "items": {"type": "string", "maxLength": 12},
        },
    },
    "required": ["title", "characters"],
    "additionalProperties": False,
}
