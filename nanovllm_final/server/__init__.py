"""An OpenAI-compatible HTTP server for the engine: `nanovllm serve MODEL` or
`python -m nanovllm_final.server MODEL` (needs the `serve` extra: FastAPI and uvicorn).

    cli.py           the command line, start-up and shutdown
    engine_thread.py one engine in one background thread, fed by a command queue
    app.py           the FastAPI routes: completions, chat, streaming, models, health, metrics
    protocol.py      OpenAI's request bodies -> SamplingParams; OpenAI's error object
    metrics.py       the Prometheus text format for /metrics
"""
