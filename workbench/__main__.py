"""Command line: `python -m workbench serve [--port N] [--model NAME] [--address HOST --basic-auth PASSWORD]
[--model-root DIR ...] [--api-port N [--api-key KEY]]` (the dashboard, and the OpenAI-compatible API beside it on
the same session), and `python -m workbench api --model NAME [--port N] [--host HOST --api-key KEY]` (the API
alone); both take the API's limits (`--max-body-mib`, `--max-concurrent-requests`, ...: ApiLimits' fields)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from runner_core import RunnerError
from workbench.api.limits import ApiLimits

API_KEY_HELP = ("a key clients must send as 'Authorization: Bearer KEY' (default: the WORKBENCH_API_KEY environment "
                "variable); needed off loopback")
# ApiLimits' fields on the command line: flag, field, the field's units per flag unit, what it bounds
LIMIT_FLAGS = (
    ("--max-body-mib", "max_body_bytes", 1 << 20, "the largest request body in MiB; over it a 413"),
    ("--max-concurrent-requests", "max_concurrent_requests", 1,
     "generation requests served at once; more wait in the queue, unread"),
    ("--max-queued-requests", "max_queued_requests", 1, "generation requests waiting for a slot; past them a 429"),
    ("--max-stop-sequences", "max_stop_sequences", 1, "stop strings in one request; more is a 400"),
    ("--max-stop-chars", "max_stop_chars", 1, "characters in one stop string; more is a 400"),
    ("--max-messages", "max_messages", 1, "chat messages in one request; more is a 400"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="serve the Panel dashboard")
    srv.add_argument("--port", type=int, default=5006, help="port (0 picks a free one); default 5006")
    srv.add_argument("--address", default="127.0.0.1",
                     help="interface to bind; default 127.0.0.1 (loopback only). Any other address (0.0.0.0 exposes "
                          "it to the network) needs --basic-auth (and --api-key for the API)")
    srv.add_argument("--basic-auth", default=None, metavar="PASSWORD",
                     help="a password, or a JSON file of {user: password}, asked at a login page")
    srv.add_argument("--model-root", action="append", default=[], metavar="DIR",
                     help="a folder the dashboard's path box may load models from (repeatable); the presets and "
                          "the Hugging Face cache are always allowed")
    srv.add_argument("--api-port", type=int, default=None, metavar="N",
                     help="also serve the OpenAI-compatible API on this port (0 picks a free one), same session")
    _model_args(srv, required=False)
    srv.add_argument("--show", action="store_true", help="open a browser tab")
    _limit_args(srv, "API limits (with --api-port)")
    api = sub.add_parser("api", help="serve the OpenAI-compatible API alone")
    api.add_argument("--port", type=int, default=8000, help="port (0 picks a free one); default 8000")
    api.add_argument("--host", default="127.0.0.1",
                     help="interface to bind; default 127.0.0.1 (loopback only); any other needs --api-key")
    _model_args(api, required=True)
    api.add_argument("--kv-cache-mib", type=int, default=None, metavar="MIB",
                     help="KV cache size in MiB (default: sized by the runner)")
    api.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    _limit_args(api, "API limits")
    return parser


def _limit_args(parser: argparse.ArgumentParser, title: str) -> None:
    group, defaults = parser.add_argument_group(title), ApiLimits()
    for flag, field, unit, doc in LIMIT_FLAGS:
        default = getattr(defaults, field) // unit
        group.add_argument(flag, type=_at_least(ApiLimits.least(field)), default=default, metavar="N",
                           help=f"{doc}; default {default}")


def _at_least(least: int):
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an int >= {least}")
        return value

    return count


def api_limits(args: argparse.Namespace) -> ApiLimits:
    """The ApiLimits the parsed flags ask for (each flag's default is the field's)."""
    return ApiLimits(**{field: getattr(args, flag[2:].replace("-", "_")) * unit
                        for flag, field, unit, _ in LIMIT_FLAGS})


def _model_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--model", default=None, required=required,
                        help="load this preset or local directory before serving")
    parser.add_argument("--dtype", default=None, help="dtype for --model (default float32)")
    parser.add_argument("--device", default=None, help="device for --model (default: cuda when present, else cpu)")
    parser.add_argument("--api-key", default=os.environ.get("WORKBENCH_API_KEY"), metavar="KEY", help=API_KEY_HELP)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bokeh").setLevel(logging.WARNING)
    from workbench.session import Session

    session = Session.current()
    try:
        return serve_api_alone(session, args) if args.command == "api" else serve_dashboard(session, args)
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        session.close()


def serve_dashboard(session, args) -> int:
    from workbench.api import check_exposure, serve_api
    from workbench.views.controller import default_device, load_config
    from workbench.views.forms import DEFAULT_LOAD
    from workbench.views.panel_app import serve

    if args.api_port is not None:
        check_exposure(args.address, args.api_key)  # before a model loads
    if args.model:
        config = load_config(args.dtype or DEFAULT_LOAD["dtype"], args.device or default_device(),
                             DEFAULT_LOAD["kv_cache_memory_mib"], DEFAULT_LOAD["max_model_len"])
        entry = session.load_model(args.model, **config)
        print(f"loaded {entry.name} in {entry.load_seconds:.1f} s", flush=True)
    server = serve(session, port=args.port, address=args.address, show=args.show, basic_auth=args.basic_auth,
                   model_roots=args.model_root)
    if args.api_port is not None:
        api = serve_api(session, port=args.api_port, host=args.address, api_key=args.api_key,
                        limits=api_limits(args))
        print(f"OpenAI API: {api.url}/v1", flush=True)
    print(f"Workbench dashboard: {server.url}", flush=True)
    server.start()
    server.io_loop.start()
    return 0


def serve_api_alone(session, args) -> int:
    import torch

    from workbench.api import check_exposure, serve_api

    check_exposure(args.host, args.api_key)
    config = {"dtype": args.dtype or "float32", "device": args.device or ("cuda" if torch.cuda.is_available() else
                                                                          "cpu")}
    if args.kv_cache_mib:
        config["kv_cache_memory"] = args.kv_cache_mib << 20
    if args.max_model_len:
        config["max_model_len"] = args.max_model_len
    entry = session.load_model(args.model, **config)
    print(f"loaded {entry.name} in {entry.load_seconds:.1f} s", flush=True)
    api = serve_api(session, port=args.port, host=args.host, api_key=args.api_key, limits=api_limits(args))
    print(f"OpenAI API: {api.url}/v1", flush=True)
    threading.Event().wait()  # until Ctrl-C; the server runs in its thread
    return 0


if __name__ == "__main__":
    sys.exit(main())
