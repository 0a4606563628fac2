"""`nanovllm serve MODEL [engine options] [--host 127.0.0.1] [--port 8000]`, also
`python -m nanovllm_final.server MODEL ...`.

Start-up: bind the port, start the engine core process and build the engine there (errors
are printed, exit code 2), then serve with uvicorn. SIGINT or SIGTERM: stop accepting
connections, give in-flight requests `--shutdown-timeout` seconds to finish, abort the
rest (their streams still end with [DONE]), stop the engine process (tensor-parallel
workers included) and exit with code 0; signals that come while it stops change nothing.
If the engine process dies, or hangs while requests wait (--watchdog-timeout), every waiting
request gets a 503 and the server exits with code 1, for a supervisor to restart it."""

import argparse
import gc
import logging
import signal
import socket
import sys

from ..engine_flags import MODEL_HELP, add_engine_options, engine_options

log = logging.getLogger("nanovllm.server")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` command to a console script's subparsers; it runs `serve(args)`."""
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    parser.set_defaults(func=serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    """`python -m nanovllm_final.server`: the `serve` command on its own."""
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm_final.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    serve(parser.parse_args(argv))


def configure(parser: argparse.ArgumentParser) -> None:
    _add_address_options(parser)
    _add_client_limits(parser)
    _add_lifetime_options(parser)
    add_engine_options(parser)


def _add_address_options(parser: argparse.ArgumentParser) -> None:
    """What is served, where, and under which name."""
    parser.add_argument("model", nargs="?", help=MODEL_HELP)
    parser.add_argument(
        "--model",
        dest="model_option",
        metavar="MODEL",
        help="the same as the first argument (as generate takes it)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=8000,
        help="port to listen on, 0..65535, 0: one the system picks (default: %(default)s)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the model's name)",
    )


def _add_client_limits(parser: argparse.ArgumentParser) -> None:
    """What a client may ask of the server: requests in flight, body sizes, connections, pace."""
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=None,
        help="sequences in flight (prompts x n) past which new requests get HTTP 503 (default: 4 x max_num_seqs)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=_positive(int),
        default=8 << 20,
        help="largest request body accepted (default: %(default)s)",
    )
    parser.add_argument(
        "--header-timeout",
        type=_positive(float),
        default=10.0,
        help="seconds a connection has to send a request's headers (default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections",
        type=_positive(int),
        default=4096,
        help="open connections past which the idle ones are closed, and, while all are busy, a "
        "request gets HTTP 503 (/health is always answered) (default: %(default)s)",
    )
    parser.add_argument(
        "--body-timeout",
        type=_positive(float),
        default=30.0,
        help="seconds a client has to send a request's body (default: %(default)s)",
    )
    parser.add_argument(
        "--max-stream-backlog",
        type=_positive(int),
        default=256,
        help="engine steps a streaming client may fall behind before it is cut off (default: %(default)s)",
    )
    parser.add_argument(
        "--large-request-bytes",
        type=_positive(int),
        default=256 << 10,
        help="bodies larger than this are parsed on threads of their own, at most 8 waiting; "
        "past that, HTTP 503 (default: %(default)s)",
    )


def _add_lifetime_options(parser: argparse.ArgumentParser) -> None:
    """How long a request, a stalled engine and a shutdown may take; the log level."""
    parser.add_argument(
        "--request-timeout",
        type=_positive(float),
        default=None,
        help="seconds a request may take from arrival; then it is aborted with HTTP 504 "
        "(a stream: an error event) (default: none)",
    )
    parser.add_argument(
        "--watchdog-timeout",
        type=_positive(float, zero=True),
        default=60.0,
        help="seconds the engine may give no sign of progress while requests wait; then they get "
        "HTTP 503 and the server exits with code 1; 0: no watchdog (default: %(default)s)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def serve(args: argparse.Namespace) -> None:
    args.model = _one_model(args)
    try:
        from .app import Limits, Server
        from .http_server import run
    except ImportError as err:
        print(
            f"error: the server needs FastAPI and uvicorn ({err}); install them with pip install 'nanovllm-staged[serve]'",
            file=sys.stderr,
        )
        sys.exit(2)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        sock = _listen(args.host, args.port)
    except OSError as err:
        print(
            f"error: cannot listen on {args.host}:{args.port}: {err.strerror or err}",
            file=sys.stderr,
        )
        sys.exit(2)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # while loading: stop cleanly
    client = _start_engine(args)
    try:
        names = _served_names(args, client)
        # uvicorn re-raises the signal that stopped it once it is done, and more may come while
        # the engine stops: from here on they change nothing (the shutdown is bounded in time)
        # (SIG_IGN, not a Python handler: the interpreter's exit keeps it, so a late signal cannot make it -15)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        log.info(
            "serving %s as %r on http://%s:%d",
            args.model,
            names[0],
            args.host,
            sock.getsockname()[1],
        )
        limits = Limits(
            max_body_bytes=args.max_request_bytes,
            body_timeout_s=args.body_timeout,
            large_body_bytes=args.large_request_bytes,
            request_timeout_s=args.request_timeout,
        )
        server = Server(client, names, args.shutdown_timeout, limits)
        gc.freeze()  # what start-up built (the tokenizer, the libraries) is never traversed by a collection again
        run(
            server,
            sock,
            args.log_level,
            header_timeout_s=args.header_timeout,
            max_connections=args.max_connections,
        )
    finally:
        client.stop()
    if client.failed:  # a supervisor (systemd, Kubernetes, a router's) restarts the server
        log.error("exiting with code 1: %s", client.error)
        sys.exit(1)
    log.info("engine stopped")


def _one_model(args: argparse.Namespace) -> str:
    """The model, given once: as the first argument or as --model (else exit with code 2)."""
    given = {m for m in (args.model, args.model_option) if m is not None}
    if len(given) != 1:
        print("error: give the model once, as the first argument or as --model", file=sys.stderr)
        sys.exit(2)
    return given.pop()


def _served_names(args: argparse.Namespace, client) -> list[str]:
    """The names clients may pass as `model`: the served one, and the path as given too."""
    names = [args.served_model_name or client.info["model_name"]]
    return names + [alias for alias in (args.model,) if alias not in names]


def _start_engine(args: argparse.Namespace):
    """The engine client, its core process started and the engine built there (errors: exit 2)."""
    from .engine_client import EngineClient

    client = EngineClient(
        args.model,
        engine_options(args),
        args.max_pending_requests,
        args.max_stream_backlog,
        watchdog_s=args.watchdog_timeout or None,
    )
    try:
        client.start()
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    return client


def _listen(host: str, port: int) -> socket.socket:
    """Bind the port before the engine is built, so that a port in use fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{port} is not a port number (0..65535; 0: one the system picks)"
        )
    return port


def _positive(kind: type, zero: bool = False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value >= 0 if zero else value > 0):
            raise argparse.ArgumentTypeError(f"{text} must be {'>=' if zero else '>'} 0")
        return value

    return parse


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
