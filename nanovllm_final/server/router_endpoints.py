"""The endpoints that routers in front of several servers call, in the shapes they read.

sglang-router (`pip install sglang-router`) asks each worker for `/get_server_info` and
`/get_model_info` (also without `get_`) when it registers it, and polls `/get_load`: a list
with one entry per data-parallel rank, `num_tokens` its load. vllm-router's cache-aware
policy tokenizes a request on a worker first: `/tokenize` (vLLM's shape: `tokens`, `count`,
`max_model_len`; tokenizer_routes.py), or `/v1/completions/render` and
`/v1/chat/completions/render` (vLLM's shape: the prompt's `token_ids`, one object per prompt
for completions), which take a completion's or a chat's body and tokenize it as those do, on
the worker threads (limits.py)."""

from fastapi import FastAPI, Request

from .limits import parse_json

GAUGES_TIMEOUT_S = (
    1.0  # /get_load answers from the API side alone if the engine is slower than this
)


def add_router_endpoints(app: FastAPI, server) -> None:
    model_info, server_info, load = _info_handlers(server)
    for path, handler in (("server_info", server_info), ("model_info", model_info), ("load", load)):
        app.add_api_route(f"/get_{path}", handler, methods=["GET"])
        if path != "load":
            app.add_api_route(f"/{path}", handler, methods=["GET"])
    _add_render_routes(app, server)


def _info_handlers(server) -> tuple:
    """sglang-router's GET handlers: (model info, server info, load)."""
    client = server.client

    def model_info() -> dict:
        config, model = client.config, client.model_config
        return {
            "model_path": config.model,
            "tokenizer_path": client.info.get("tokenizer"),
            "is_generation": True,
            "served_model_name": server.names[0],
            "max_context_length": server.max_model_len,
            "vocab_size": model.vocab_size,
            "architectures": [model.architecture],
            "eos_token_ids": list(model.eos_token_ids),
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    def server_info() -> dict:
        config = client.config
        return {
            **model_info(),
            "context_length": server.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_running_requests": config.max_num_seqs,
            "max_pending_requests": client.max_pending,
            "page_size": config.kvcache_block_size,
            "tp_size": config.tensor_parallel_size,
            "dp_size": 1,
            "version": "nanovllm",
        }

    async def load() -> list[dict]:
        gauges = await client.gauges(GAUGES_TIMEOUT_S) or {}
        waiting = gauges.get("waiting", 0)
        tokens = gauges.get("blocks_used", 0) * client.config.kvcache_block_size
        return [
            {
                "dp_rank": 0,
                "num_reqs": client.in_flight,
                "num_waiting_reqs": waiting,
                "num_tokens": tokens,
            }
        ]

    return model_info, server_info, load


def _add_render_routes(app: FastAPI, server) -> None:
    """vllm-router's /v1/completions/render and /v1/chat/completions/render."""

    async def tokens_of(request: Request) -> list[list[int]]:
        """The body's prompts (chat: its `messages` through the template) as token ids, parsed,
        checked and tokenized on the worker threads like a completion's."""
        body = await server.read_body(request)

        def work(raw: bytes) -> list[list[int]]:
            data = parse_json(raw)
            chat = isinstance(data, dict) and "messages" in data
            return server.prepare(server.endpoints[chat], raw, data=data, generate=False)[1]

        return await server.workers.run(body, work)

    @app.post("/v1/completions/render")
    async def render_completion(request: Request):
        prompts = await tokens_of(request)
        return [{"token_ids": ids, "features": None, "model": server.names[0]} for ids in prompts]

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request):
        prompts = await tokens_of(request)
        return {"token_ids": prompts[0], "features": None, "model": server.names[0]}
