"""The server's pieces that need no server process: how a handle's updates merge into
replies, how a failed request ends, and what a body must be to be JSON the server takes."""

import asyncio
import math

import pytest

from nanovllm_final.server.app import Reply, _finite, _sse
from nanovllm_final.server.limits import parse_json
from nanovllm_final.server.protocol import RequestError


class FakeHandle:
    def __init__(self, items: list[tuple], choices: int = 2):
        self.queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            self.queue.put_nowait(item)
        self.choices = [None] * choices
        self.prompts = [[1, 2, 3]]
        self.cached_tokens = [2]


def collect(items: list[tuple], keep_logprobs: bool = True) -> tuple[Reply, list[dict]]:
    async def run():
        reply = Reply(FakeHandle(items), keep_logprobs)
        return reply, [merged async for merged in reply.updates()]

    return asyncio.run(asyncio.wait_for(run(), 5))


def test_updates_that_queued_up_merge_into_one_per_choice():
    lp = {"token_id": 5, "logprob": -0.5, "top_logprobs": {}}
    reply, wakeups = collect(
        [
            ("updates", [(0, "a", [5], [lp], None)], False),
            ("updates", [(0, "b", [6], [lp], None), (1, "x", [7], [lp], None)], False),
            ("updates", [(0, "", [8], [lp], "stop"), (1, "y", [9], [lp], "length")], True),
        ]
    )
    assert wakeups == [
        {0: ["ab", [5, 6, 8], [lp] * 3, "stop"], 1: ["xy", [7, 9], [lp] * 2, "length"]}
    ]  # one wake-up
    assert ["".join(t) for t in reply.text] == ["ab", "xy"] and reply.finish_reason == [
        "stop",
        "length",
    ]
    assert reply.usage() == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_a_request_the_engine_failed_on_is_an_error_after_its_text():
    async def run():
        reply = Reply(
            FakeHandle(
                [
                    ("updates", [(0, "par", [5], [], None)], False),
                    ("updates", [(0, "tial", [6], [], "error")], True),
                ]
            ),
            False,
        )
        seen = []
        with pytest.raises(RequestError) as err:
            async for merged in reply.updates():
                seen.append(merged)
        return seen, err.value

    seen, err = asyncio.run(run())
    assert seen == [{0: ["partial", [5, 6], [], "error"]}]
    assert err.status == 500 and err.code == "engine_error"


@pytest.mark.parametrize(
    "raw, words",
    [
        (b'{"a": NaN}', "NaN"),
        (b'{"a": -Infinity}', "Infinity"),
        (b"[" * 50000 + b"]" * 50000, "nested"),
        (b'{"a": ' + b"1" * 5000 + b"}", "not valid JSON"),
        (b'{"a": "\\udc00"}', "lone surrogate"),
        (b"\xff\xfe{", "not valid JSON"),
    ],
)
def test_bodies_the_server_does_not_take(raw, words):
    with pytest.raises(RequestError, match=words) as err:
        parse_json(raw)
    assert err.value.status == 400


def test_logprobs_json_can_carry():
    assert _finite(-math.inf) == -9999.0 and _finite(math.nan) is None and _finite(-0.25) == -0.25
    with pytest.raises(
        ValueError
    ):  # anything non-finite that slipped through fails loudly, never as invalid JSON
        _sse({"x": math.nan})
    assert parse_json('{"a": "日本 😀", "b": [1, 2.5]}'.encode()) == {"a": "日本 😀", "b": [1, 2.5]}
