"""`nanovllm serve MODEL [engine options] [--host 127.0.0.1] [--port 8000]`, also
`python -m nanovllm_final.server MODEL ...`.

Start-up: build the engine on its thread (errors are printed, exit code 2), then serve
with uvicorn. SIGINT or SIGTERM: stop accepting connections, give in-flight requests
`--shutdown-timeout` seconds to finish, abort the rest (their streams still end with
[DONE]), shut the engine down (tensor-parallel workers included) and exit with code 0."""

import argparse
import logging
import signal
import sys

from ..engine_flags import MODEL_HELP, add_engine_options, engine_options

log = logging.getLogger("nanovllm.server")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` command to a console script's subparsers; it runs `serve(args)`."""
    parser = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    parser.set_defaults(func=serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    """`python -m nanovllm_final.server`: the `serve` command on its own."""
    parser = argparse.ArgumentParser(prog="python -m nanovllm_final.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    serve(parser.parse_args(argv))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=MODEL_HELP)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the model's name)")
    parser.add_argument("--max-pending-requests", type=int, default=None,
                        help="requests in flight past which new ones get HTTP 503 (default: 4 x max_num_seqs)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(parser)


def serve(args: argparse.Namespace) -> None:
    try:
        from .app import Server, run
    except ImportError as err:
        print(f"error: the server needs FastAPI and uvicorn ({err}); install them with pip install 'nanovllm-staged[serve]'", file=sys.stderr)
        sys.exit(2)
    from .engine_thread import EngineThread

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # while loading: stop cleanly
    try:
        engine = EngineThread(args.model, engine_options(args), args.max_pending_requests)
        engine.start()
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    try:
        names = [args.served_model_name or engine.llm.model_name]
        names += [alias for alias in (args.model,) if alias not in names]  # the path as given is accepted too
        # uvicorn re-raises the signal that stopped it once it is done; by then we stop quietly
        signal.signal(signal.SIGTERM, _ignore)
        signal.signal(signal.SIGINT, _ignore)
        log.info("serving %s as %r on http://%s:%d", args.model, names[0], args.host, args.port)
        run(Server(engine, names, args.shutdown_timeout), args.host, args.port, args.log_level)
    finally:
        engine.stop()
        signal.signal(signal.SIGTERM, previous)
    log.info("engine stopped")


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _ignore(signum, frame):
    pass
