"""Command line: `python -m workbench serve [--port N] [--model NAME] [--address HOST --basic-auth PASSWORD]
[--model-root DIR ...]`."""

from __future__ import annotations

import argparse
import logging
import sys

from runner_core import RunnerError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="serve the Panel dashboard")
    srv.add_argument("--port", type=int, default=5006, help="port (0 picks a free one); default 5006")
    srv.add_argument("--address", default="127.0.0.1",
                     help="interface to bind; default 127.0.0.1 (loopback only). Any other address (0.0.0.0 exposes "
                          "it to the network) needs --basic-auth")
    srv.add_argument("--basic-auth", default=None, metavar="PASSWORD",
                     help="a password, or a JSON file of {user: password}, asked at a login page")
    srv.add_argument("--model-root", action="append", default=[], metavar="DIR",
                     help="a folder the dashboard's path box may load models from (repeatable); the presets and "
                          "the Hugging Face cache are always allowed")
    srv.add_argument("--model", default=None, help="load this preset or local directory before serving")
    srv.add_argument("--dtype", default=None, help="dtype for --model (default float32)")
    srv.add_argument("--device", default=None, help="device for --model (default: cuda when present, else cpu)")
    srv.add_argument("--show", action="store_true", help="open a browser tab")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bokeh").setLevel(logging.WARNING)
    from workbench.controller import DEFAULT_LOAD, default_device, load_config
    from workbench.panel_app import serve
    from workbench.session import Session

    session = Session.current()
    if args.model:
        config = load_config(args.dtype or DEFAULT_LOAD["dtype"], args.device or default_device(),
                             DEFAULT_LOAD["kv_cache_memory_mib"], DEFAULT_LOAD["max_model_len"])
        try:
            entry = session.load_model(args.model, **config)
        except RunnerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"loaded {entry.name} in {entry.load_seconds:.1f} s", flush=True)
    try:
        server = serve(session, port=args.port, address=args.address, show=args.show, basic_auth=args.basic_auth,
                       model_roots=args.model_root)
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        session.close()
        return 2
    print(f"Workbench dashboard: {server.url}", flush=True)
    server.start()
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
