"""Structured output through the server, with the official `openai` client: response_format
(json_schema, json_object) and vLLM's structured_outputs on chat and completions, streamed and
not; the client's parse() with a pydantic model; a grammar that cannot compile is a 400."""

import json
import signal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import ServerProcess

from benchmarks.structured_schemas import SCHEMAS

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.xdist_group("processes")
SCHEMA = SCHEMAS[11]  # nested object, array of enums, pattern
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "user", "schema": SCHEMA, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Describe a user."}]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=20)


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir("qwen3"), tmp_path_factory.mktemp("server") / "server.log")
    yield srv.client()
    code = srv.stop(signal.SIGINT)
    assert code == 0, f"SIGINT: exit code {code}\n{srv.output()}"


def valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_on_chat_and_completions(client, stream):
    chat = client.chat.completions.create(
        model="tiny-qwen3",
        messages=MESSAGES,
        max_tokens=96,
        temperature=0.8,
        seed=1,
        n=2,
        response_format=RESPONSE_FORMAT,
        stream=stream,
    )
    completion = client.completions.create(
        model="tiny-qwen3",
        prompt="A user:",
        max_tokens=96,
        temperature=0,
        extra_body={"response_format": RESPONSE_FORMAT},
        stream=stream,
    )
    if stream:
        texts: dict[tuple, list[str]] = {}
        for chunk in chat:
            for c in chunk.choices:
                texts.setdefault(("chat", c.index), []).append(c.delta.content or "")
        for chunk in completion:
            for c in chunk.choices:
                texts.setdefault(("cmpl", c.index), []).append(c.text)
        outputs = ["".join(parts) for parts in texts.values()]
    else:
        assert (
            all(c.finish_reason == "stop" for c in chat.choices)
            and completion.choices[0].finish_reason == "stop"
        )
        outputs = [c.message.content for c in chat.choices] + [completion.choices[0].text]
    assert len(outputs) == 3
    for text in outputs:
        valid(text)


def test_json_object_and_structured_outputs(client):
    """json_object: the output is a JSON object (or the start of one, cut by max_tokens);
    vLLM's structured_outputs extra field on completions (choice) and chat (regex)."""
    out = client.chat.completions.create(
        model="tiny-qwen3",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_object"},
    ).choices[0]
    assert out.message.content.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    choice = client.completions.create(
        model="tiny-qwen3",
        prompt="Pick:",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert all(
        c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in choice.choices
    )
    regex = client.chat.completions.create(
        model="tiny-qwen3",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}},
    )
    assert regex.choices[0].message.content[3] == "-" and len(regex.choices[0].message.content) == 6


def test_parse_with_a_pydantic_model(client):
    parse = (
        client.chat.completions.parse
        if hasattr(client.chat.completions, "parse")
        else client.beta.chat.completions.parse
    )
    out = parse(
        model="tiny-qwen3", messages=MESSAGES, max_tokens=64, temperature=0, response_format=Pet
    )
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.age <= 20


def test_formats_that_cannot_be_served_are_400(client):
    bad = {
        "unsupported type": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "frob"}},
            }
        },
        "unsupported keyword": {
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}
        },
        "no schema": {"response_format": {"type": "json_schema"}},
        "unknown type": {"response_format": {"type": "yaml"}},
        "bad regex": {"structured_outputs": {"regex": "[a-"}},
        "10,000 properties": {
            "structured_outputs": {"json": {"properties": {f"p{i}": {} for i in range(10_000)}}}
        },
        "two": {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    }
    for name, body in bad.items():
        for create, prompt in (
            (client.completions.create, {"prompt": "x"}),
            (client.chat.completions.create, {"messages": MESSAGES}),
        ):
            with pytest.raises(openai.BadRequestError) as err:
                create(model="tiny-qwen3", max_tokens=4, extra_body=body, **prompt)
            assert err.value.body["param"] in ("response_format", "structured_outputs"), (
                name,
                err.value.body,
            )
    assert (
        client.completions.create(model="tiny-qwen3", prompt="x", max_tokens=2)
        .choices[0]
        .finish_reason
        == "length"
    )
