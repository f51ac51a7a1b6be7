"""`tinyrt serve`: the model behind an OpenAI-compatible HTTP API (tinyrt.server)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from tinyrt.errors import TinyrtError, shown

from .options import (add_cache_options, add_draft_options, add_model_option, add_runtime_options,
                      load_llm, load_options, whole)

MAX_QUEUE = 64            # requests waiting for the engine
MAX_BODY = 4 << 20        # bytes of a request body (a whole context of text is far less)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over OpenAI's HTTP API (/v1/chat/completions, "
                                   "/v1/completions, /v1/responses, /v1/models, /health) and "
                                   "ollama's (/api/chat, /api/generate, /api/tags, /api/show), "
                                   "one generation at a time, the others waiting in a queue; a "
                                   "line on stderr for each request. Needs "
                                   'pip install "tinyrt[server]".')
    add_model_option(p, positional=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: "
                        "every network the machine is on)")
    p.add_argument("--port", type=whole, default=8080, help="default 8080; 0 picks a free port")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 and /api request "
                        "(default: $TINYRT_API_KEY, else none)")
    p.add_argument("--alias", default=None, metavar="NAME",
                   help="the model's name in the API (default: MODEL as given)")
    p.add_argument("--strict-model", action="store_true",
                   help="answer a request for another model with 404 (default: any model name "
                        "is the served model; its names are the --alias, MODEL as given and a "
                        "known model's names)")
    p.add_argument("--max-queue", type=whole, default=MAX_QUEUE,
                   help=f"requests that may wait for the engine; more get 503 (default {MAX_QUEUE})")
    p.add_argument("--max-body", type=whole, default=MAX_BODY, metavar="BYTES",
                   help=f"largest request body; larger get 413 (default {MAX_BODY:,})")
    r = p.add_argument_group("runtime")
    add_cache_options(r, policy="dense")
    add_draft_options(r)
    add_runtime_options(r)


def _no_upgrade_notes(record) -> bool:
    """uvicorn's log without its two lines on each request that asks for a WebSocket upgrade
    (any client may send them, as many as it likes: a flood of the log)."""
    return not str(record.msg).startswith(("Unsupported upgrade request",
                                          "No supported WebSocket library"))


def model_names(model) -> list[str]:
    """The names the served MODEL answers to beside --alias: MODEL as given and, for a known
    model, its name and its aliases ("smollm2" for the default model)."""
    from tinyrt.model_cache import DEFAULT_MODEL, KNOWN_MODELS
    from tinyrt.registry import ALIASES

    given = str(model or DEFAULT_MODEL)
    known = ALIASES.get(given, given)
    names = [given]
    if known in KNOWN_MODELS:
        names += [known, *(alias for alias, name in ALIASES.items() if name == known)]
    return list(dict.fromkeys(names))


def main(args: argparse.Namespace) -> int:
    # every option checked before anything loads
    if not 0 <= args.port <= 65535:
        raise TinyrtError(f"--port must be in [0, 65535], got {shown(args.port)}")
    if args.max_queue < 0:
        raise TinyrtError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if args.max_body < 1:
        raise TinyrtError(f"--max-body must be 1 or more, got {args.max_body}")
    load = load_options(args)
    try:
        import uvicorn

        from tinyrt.server import Server
    except ImportError:
        raise TinyrtError('the server needs its extra packages: pip install "tinyrt[server]"') \
            from None
    api_key = args.api_key or os.environ.get("TINYRT_API_KEY") or None
    if api_key is not None and any(b < 0x20 or b == 0x7f for b in os.fsencode(api_key)):
        # (HTTP servers refuse a header with one before tinyrt sees it: no client could send it)
        raise TinyrtError("the API key holds a control character, which no HTTP header can "
                          "carry: choose another (--api-key or $TINYRT_API_KEY)")
    llm = load_llm(args, load)
    names = model_names(load["model"])
    name = args.alias or names[0]
    server = Server(llm, name, api_key=api_key, max_queue=args.max_queue, max_body=args.max_body,
                    aliases=names, strict_model=args.strict_model)
    # no WebSocket (the API has none): an upgrade request is answered as any other request. No
    # access log: the app logs each request in one line of its own (server.RequestLog)
    config = uvicorn.Config(server.app(), host=args.host, port=args.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=3, ws="none")
    logging.getLogger("uvicorn.error").addFilter(_no_upgrade_notes)
    web = uvicorn.Server(config)
    started = web.startup

    async def startup(sockets=None):           # one line once the port is open (0: its number)
        await started(sockets)
        if web.started:
            host, port = web.servers[0].sockets[0].getsockname()[:2]
            url = f"http://{_url_host(host)}:{port}"
            print(f"tinyrt: serving {name!r} at {url}/v1 (OpenAI API; ollama's API at {url})"
                  f"{' · key required' if api_key else ''} · Ctrl-C stops", file=sys.stderr,
                  flush=True)

    def serve_http():
        try:
            web.run()
        finally:
            server.engine.close()

    web.startup = startup
    # the web server in a thread, the model on this one, which ran it as it loaded (Engine).
    # The kernels hold the interpreter lock: a token handed to the web thread waits for the
    # engine to let go of it, which Python asks for every 5 ms by default; 1 ms
    sys.setswitchinterval(1e-3)
    thread = threading.Thread(target=serve_http, name="tinyrt-http", daemon=True)
    thread.start()
    signal.signal(signal.SIGTERM, _interrupt)     # stop as for Ctrl-C (the web thread has
    try:                                           # no handlers of its own)
        server.engine.run()
    finally:
        server.engine.close()                      # waiting requests get their 503 now
        web.should_exit = True
        thread.join(timeout=10)
    return 0 if web.started else 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
