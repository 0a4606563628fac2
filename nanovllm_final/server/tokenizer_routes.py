"""vLLM's tokenizer endpoints: GET /tokenizer_info, POST /tokenize, POST /detokenize.

lm-evaluation-harness (`--model local-completions`, tokenizer_backend "auto") probes
/tokenizer_info (it needs "eos_token") and /tokenize; when both answer it tokenizes through the
server (and detokenizes through /detokenize) instead of loading a tokenizer of its own, so the
harness needs no local copy of the model's tokenizer."""

import asyncio

from fastapi import FastAPI, Request
from pydantic import BaseModel

from .limits import parse_json
from .protocol import STRICT, RequestError, parse


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(app: FastAPI, server) -> None:
    tokenizer = server.client.tokenizer

    async def body(request: Request, model: type[BaseModel]):
        raw = await server.read_body(request)
        return parse(model, await server.workers.run(raw, parse_json))

    async def on_pool(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(server.workers.small, fn, *args)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        names = ("eos_token", "bos_token", "pad_token", "unk_token")
        return {
            "tokenizer_class": type(tokenizer).__name__,
            **{name: getattr(tokenizer, name, None) for name in names},
            "chat_template": tokenizer.chat_template,
            "model_max_length": server.max_model_len,
            "vocab_size": len(tokenizer),
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await body(request, TokenizeRequest)
        ids = await on_pool(
            lambda: tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens, verbose=False
            )
        )
        return {
            "count": len(ids),
            "max_model_len": server.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await body(request, DetokenizeRequest)
        vocab = len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"tokens {bad[:5]} are outside the tokenizer's vocabulary [0, {vocab})", "tokens"
            )
        return {"prompt": await on_pool(tokenizer.decode, req.tokens)}
