"""``specjet serve``: the command line. Engine flags are made from ``EngineArgs``' fields with
SGLang's spellings (``speculative_algorithm`` -> ``--speculative-algorithm``)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import socket
import sys
from typing import Any, Optional, Sequence

from specjet.arg_types import port
from specjet.engine.args import EngineArgs
from specjet.serve.body_limit import DEFAULT_MAX_REQUEST_BYTES

_CONVERTERS = {"int": int, "float": float, "str": str}


class _Null:
    """An engine flag given as "none": the argument's None (float weights for --quantization, no limit for a
    grammar timeout), which a flag left out (argparse's None) could not say."""


NULL = _Null()


def _nullable(convert):
    def parse(text: str):
        return NULL if text.lower() == "none" else convert(text)
    parse.__name__ = convert.__name__  # argparse names the type in its messages
    return parse




def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine", "Engine arguments (specjet.EngineArgs, SGLang's names)")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        kinds = [k.strip() for k in str(f.type).split("|")]
        if "bool" in kinds:
            if f.default is True or f.default is None:  # None: the engine decides (e.g. per device)
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                   help="(default: on)" if f.default else "(default: auto)")
            else:
                group.add_argument(flag, dest=f.name, action="store_true", default=None)
            continue
        convert = next(_CONVERTERS[k] for k in kinds if k in _CONVERTERS)
        path = f.name.endswith("_path")
        nullable = "None" in kinds and not path  # (a path named "none" stays a path)
        group.add_argument(flag, dest=f.name, type=_nullable(convert) if nullable else convert, default=None,
                           metavar="PATH" if path else kinds[0].upper(),
                           help=f"(default: {f.default}{'; none: None' if nullable else ''})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjet serve",
                                     description="An OpenAI-compatible server (FastAPI + uvicorn) over one specjet Engine, "
                                                 "with SGLang's native POST /generate beside it.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=port, default=30000, help="0: any free port (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("SPECJET_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 and SGLang's native routes (/health and "
                             "/metrics stay open) (default: $SPECJET_API_KEY, else none)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id /v1/models reports (default: the model path's name)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request body accepted; larger ones get a 413 (default: %(default)s)")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="SGLang's flag: a streamed POST /generate sends what is new in each event (default: "
                             "each event holds the output so far, as SGLang's server sends it)")
    parser.add_argument("--allowed-origins", nargs="*", default=["*"], metavar="ORIGIN",
                        help="origins a browser may call the server from (CORS, as SGLang's and vLLM's servers allow "
                             "by default; the API key still applies); none given: no CORS headers (default: *)")
    parser.add_argument("--graceful-shutdown-s", type=int, default=30, metavar="S",
                        help="on SIGINT/SIGTERM, how long responses still running may take to end: shortly "
                             "before that, requests still running are ended and answered with a 503 "
                             "(engine_not_alive), then the process exits; a client that stopped reading is cut at the "
                             "end (default: %(default)s)")
    parser.add_argument("--debug-endpoints", action="store_true",
                        help="expose GET /debug/kv (waits until idle, checks the KV invariant)")
    _add_engine_flags(parser)
    return parser


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave (the rest keep EngineArgs' defaults)."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return {k: None if v is NULL else v for k, v in vars(ns).items() if k in names and v is not None}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `specjet serve ...`
        argv = argv[1:]
    ns = build_parser().parse_args(argv)
    if ns.max_request_bytes < 1:
        print(f"specjet serve: --max-request-bytes must be positive, got {ns.max_request_bytes}", file=sys.stderr)
        return 2
    if ns.graceful_shutdown_s < 0:
        print(f"specjet serve: --graceful-shutdown-s must be >= 0, got {ns.graceful_shutdown_s}", file=sys.stderr)
        return 2
    try:  # before the engine loads: a host that names no address was uvicorn's error after it, without the name
        socket.getaddrinfo(ns.host, ns.port)
    except (socket.gaierror, UnicodeError) as error:
        print(f"specjet serve: --host {ns.host!r} names no address to bind: {error}", file=sys.stderr)
        return 2
    import uvicorn

    import specjet
    from specjet.serve.app import create_app
    from specjet.serve.body_limit import BodyLimit
    from specjet.serve.draining import AnsweringServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    kwargs = engine_kwargs(ns)
    try:
        engine = specjet.Engine(**kwargs)
    except (TypeError, ValueError, OSError) as error:  # OSError: a model or draft path that is not there
        print(f"specjet serve: {error}", file=sys.stderr)
        return 2
    name = served_model_name(ns.served_model_name, kwargs.get("model_path"))
    app = BodyLimit(create_app(engine, name, api_key=ns.api_key, debug_endpoints=ns.debug_endpoints,
                               incremental_streaming_output=ns.incremental_streaming_output,
                               allowed_origins=ns.allowed_origins),
                    ns.max_request_bytes)
    try:
        # uvicorn's start-up lines say where it listens (the port --port 0 picked); no line per request.
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level="info", access_log=False,
                                timeout_graceful_shutdown=ns.graceful_shutdown_s)
        server = AnsweringServer(config, engine.shutdown)
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it caught again once it has shut down
            pass
        if not server.started:  # the port taken, as uvicorn.run answers it
            print(f"specjet serve: could not listen on {ns.host}:{ns.port} (the log above says why)", file=sys.stderr)
            return 3
    finally:
        engine.shutdown()
    return 0


def console_main() -> int:
    """The ``specjet`` console script: ``specjet serve [flags]``."""
    usage = "usage: specjet serve [flags]  (specjet serve --help lists them)"
    if sys.argv[1:] in (["-h"], ["--help"]):  # asked for: the usage on stdout, and success
        print(usage)
        return 0
    if sys.argv[1:2] != ["serve"]:
        print(usage, file=sys.stderr)
        return 2
    return main(sys.argv[2:])


def served_model_name(given: str | None, model_path: str | None) -> str:
    """The model id the server answers with: ``--served-model-name``, else the model path's last part as it
    resolves (``--model-path .`` is the current folder's name, not "."), else the default model's name."""
    if given:
        return given
    if not model_path:
        return "SmolLM2-135M-Instruct"
    return pathlib.Path(model_path).expanduser().resolve().name or str(model_path)
