"""An OpenAI-compatible HTTP server for the engine: `nanovllm serve MODEL` or
`python -m nanovllm_final.server MODEL` (needs the `serve` extra: FastAPI and uvicorn).

Two processes: the engine core steps the engine and never waits for HTTP; the API process
tokenizes, detokenizes and speaks HTTP. One small message per step goes between them. A
request with stop strings is decoded in the engine core, where they are matched, and its text
comes with its tokens: no text is decoded twice.

    cli.py           the command line, start-up and shutdown
    engine_core.py   the engine process: commands in, one message of deltas per step out
    engine_client.py the API process's side of it: submit, abort, decode, answer every request
    app.py           the FastAPI routes: completions and chat (one path), models, health, metrics
    http_server.py   uvicorn with header and keep-alive timeouts, connection limits, and a graceful shutdown
    limits.py        what a request may take, checked in the order of cost, off the event loop
    watchdog.py      the engine core's heartbeat; a hung engine becomes 503s and an exit with code 1
    router_endpoints.py  /get_server_info, /get_load, /tokenize, ...: what routers in front of replicas read
    protocol.py      OpenAI's request bodies -> SamplingParams; OpenAI's error object
    metrics.py       the Prometheus text format for /metrics
"""
