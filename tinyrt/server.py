"""`tinyrt serve`: an OpenAI-compatible HTTP API over one loaded `LLM` (an ASGI app on starlette),
and ollama's API beside it.

Endpoints: POST /v1/chat/completions, /v1/completions and /v1/responses (streamed as server-sent
events or whole), GET /v1/models, /v1/models/{id} and /health; ollama's GET /api/tags,
/api/version and POST /api/show, /api/chat, /api/generate (streamed as NDJSON or whole).
Requests and responses have OpenAI's shapes (ollama's on /api/); errors are OpenAI's error
object (ollama's {"error": ...} on /api/) with the status its meaning takes (400 a bad body or
field, 401 a missing or wrong key, 404 an unknown endpoint, or model with `strict_model`, 413 a
body over the limit, 503 a full queue). Any model name is taken unless `strict_model`: the one
model answers, and each reply names it. Each request gets one log line once it is answered.

One engine, one generation at a time (the runtime is single-stream): a request is checked and
tokenized as it arrives (a prompt the cache cannot hold gets its 400 at once), then waits in a
bounded FIFO queue for the one worker thread that runs `LLM.complete`. `complete` keeps the KV
cache's longest common prefix with the previous request, so a conversation's next turn
prefills only its new tokens. The worker hands each `Response` to the event loop; a client that
goes away (or cancels a stream) cancels its request, which the worker sees before its next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import math
import os
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from datetime import datetime, timezone
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tinyrt.errors import SURROGATE, TinyrtError, shown

from .chat import conversation_ids, conversation_template, fit_turns, with_template_stops
from .sampling import (ALIASES, OPTIONS, SamplingParams, SettingError, check_settings,
                       check_value, unknown_option)

DRAIN = 64 << 20
MAX_BACKLOG = 1024
MAX_EMBED_INPUTS = 256      # the texts one /api/embed request may give
ROLES = ("system", "developer", "user", "assistant", "tool")
TOKENS = "tinyrt.tokens"    # a request's ASGI scope: [prompt, reply] tokens, for its log line


class APIError(Exception):
    """An error answered with OpenAI's error object."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             413: "invalid_request_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self, ollama: bool = False) -> JSONResponse:
        """The error as OpenAI's error object, or as ollama's {"error": message}."""
        headers = {"Retry-After": "1"} if self.status == 503 else None
        body = {"error": self.message} if ollama else self.body()
        return JSON(body, status_code=self.status, headers=headers)


# -- requests ----------------------------------------------------------------------------------

def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}' {message}", param=param, code="invalid_value")


def _refuse(body: dict, name: str, ok, what: str) -> None:
    """A 400 for an OpenAI field this server does not do, unless it has a value that asks for
    nothing (`ok(value)`)."""
    if name in body and body[name] is not None and not ok(body[name]):
        raise _invalid(name, f"is not supported by this server ({what})")


def sampling_options(body: dict, max_tokens: int, renames: dict[str, str] | None = None) -> dict:
    """`LLM.complete` options from OpenAI's fields (and llama.cpp's extras: top_k, min_p,
    repeat_penalty, ignore_eos; and the other runtimes' names, sampling.ALIASES), checked as
    every front end's (sampling.check_settings; seed -1 is a random seed, as llama.cpp has it).
    `renames` are an API's own names for options ({"max_output_tokens": "max_tokens"}), checked
    by the same rules under the name the client sent, and over ours where both are given.
    Absent fields take the model's generation_config.json or the sampler's defaults;
    max_tokens defaults to the cache size."""
    _refuse(body, "n", lambda v: v == 1, "one choice per request")
    _refuse(body, "best_of", lambda v: v == 1, "one choice per request")
    _refuse(body, "logprobs", lambda v: v is False, "no log probabilities")
    _refuse(body, "top_logprobs", lambda v: v == 0, "no log probabilities")
    _refuse(body, "logit_bias", lambda v: v == {}, "no logit bias")
    _refuse(body, "echo", lambda v: v is False, "the reply only")
    _refuse(body, "suffix", lambda v: v == "", "no insertion")
    _refuse(body, "tools", lambda v: v == [], "no tool calls")
    _refuse(body, "functions", lambda v: v == [], "no function calls")
    _refuse(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
            "text replies only")
    # (an alias, listed after our name, wins where both are given: OpenAI's newer
    # max_completion_tokens over max_tokens)
    fields = {key: body.get(key) for key in (*OPTIONS, *ALIASES)}
    try:
        opts = check_settings(fields)
        for name, key in (renames or {}).items():
            value = check_value(key, body.get(name), name)
            if value is not None:
                opts[key] = value
    except SettingError as e:
        raise APIError(400, str(e), param=e.name, code="invalid_value") from None
    opts["max_tokens"] = opts["max_tokens"] or max_tokens
    return {k: v for k, v in opts.items() if v is not None}


def _text(param: str, value: str) -> str:
    """A string of the request, checked to be text (JSON's \\ud800 escapes decode to lone
    surrogates, which no tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(param, "is not valid Unicode text (a lone surrogate)") from None
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise _invalid(name, "must be true or false")
    return v


def _message(where: str, m, parts: tuple[str, ...]) -> dict:
    """One message as the chat template takes it: a role of ROLES (developer as system), its
    content a string or text parts (of the types `parts`, joined)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise _invalid(where, f"must be an object with a 'role' of {', '.join(ROLES)}")
    content = m.get("content")
    if content is None and m["role"] == "assistant":
        content = ""
    elif isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in parts
                   and isinstance(p.get("text"), str) for p in content):
            raise _invalid(where, f"content parts must be text parts ({{'type': '{parts[0]}', "
                                  "'text': ...}); this model reads text only")
        content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise _invalid(where, "needs a string 'content'")
    role = "system" if m["role"] == "developer" else m["role"]
    return {"role": role, "content": _text(where, content)}


def chat_messages(body: dict) -> list[dict]:
    """The request's messages as the chat template takes them: string contents (text parts
    joined), a developer message as a system message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "must be a non-empty list of messages")
    return [_message(f"messages[{i}]", m, ("text",)) for i, m in enumerate(messages)]


# -- the Responses API's requests --------------------------------------------------------------

def _text_format(v) -> bool:
    """Whether a Responses API `text` field asks for plain text."""
    fmt = v.get("format") if isinstance(v, dict) else None
    return isinstance(v, dict) and (fmt is None or isinstance(fmt, dict)
                                    and fmt.get("type") == "text")


def responses_options(body: dict, max_tokens: int) -> dict:
    """`LLM.complete` options from a Responses API request: its own fields refused where they ask
    for what this server does not do, then the chat endpoint's checks (`sampling_options`), with
    max_output_tokens for max_tokens."""
    stored = "nothing is stored here: send the conversation as 'input'"
    _refuse(body, "previous_response_id", lambda v: False, stored)
    _refuse(body, "conversation", lambda v: False, stored)
    _refuse(body, "prompt", lambda v: False, "no stored prompts")
    _refuse(body, "background", lambda v: v is False, "replies are streamed or whole")
    _refuse(body, "tool_choice", lambda v: v in ("none", "auto"), "no tool calls")
    _refuse(body, "text", _text_format, "text replies only")
    _refuse(body, "reasoning", lambda v: isinstance(v, dict) and v.get("effort") in (None, "none")
            and not v.get("summary"), "this model does not reason")
    _refuse(body, "include", lambda v: v == [], "nothing to include")
    _refuse(body, "truncation", lambda v: v == "disabled",
            "a prompt longer than the context is refused, not truncated")
    metadata = body.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                    and not SURROGATE.search(k + v) for k, v in metadata.items())):
        # (echoed in the reply: checked as OpenAI checks it, and as text the other fields are)
        raise _invalid("metadata", "must be an object of at most 16 keys of up to 64 "
                                   "characters, each with a string of up to 512 (text: no lone "
                                   "surrogates)")
    return sampling_options(body, max_tokens, renames={"max_output_tokens": "max_tokens"})


def response_messages(body: dict) -> list[dict]:
    """A Responses API request's `instructions` (the system message) and `input` (a string: one
    user message; or a list of messages, their content a string or input_text / output_text
    parts) as the chat template takes them."""
    instructions, given = body.get("instructions"), body.get("input")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("instructions", "must be a string")
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    elif not isinstance(given, list) or not given:
        raise _invalid("input", "must be a string or a non-empty list of messages")
    out = [{"role": "system", "content": _text("instructions", instructions)}] \
        if instructions else []
    for i, m in enumerate(given):
        if isinstance(m, dict) and m.get("type", "message") != "message":
            raise _invalid(f"input[{i}]", f"is an item of type {shown(m['type'])}; this server "
                                          "takes messages only (no tools, nothing stored)")
        out.append(_message(f"input[{i}]", m, ("input_text", "output_text")))
    return out


# -- ollama's requests -------------------------------------------------------------------------

# ollama's options that set up its runtime rather than choose tokens: `tinyrt serve`'s flags do
# that here, so they are taken and have no effect (ollama's front ends send them)
OLLAMA_RUNTIME = ("numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv",
                  "logits_all", "vocab_only", "use_mmap", "use_mlock", "num_thread", "num_keep",
                  "embedding_only", "penalize_newline", "mirostat_tau", "mirostat_eta")
# ollama's samplers tinyrt has not, taken at the values that ask for nothing more
OLLAMA_OFF = (("mirostat", lambda v: v == 0, "no mirostat sampling"),
              ("typical_p", lambda v: v == 1, "no typical sampling"),
              ("tfs_z", lambda v: v == 1, "no tail-free sampling"),
              ("repeat_last_n", lambda v: v == SamplingParams.repeat_last_n,
               f"the penalties look back over {SamplingParams.repeat_last_n} tokens"))


def ollama_options(body: dict, max_tokens: int) -> dict:
    """`LLM.complete` options from an ollama request's `options` (its names: num_predict for
    max_tokens, -1 or -2 for as many as the cache holds; the others are ours), checked as the
    chat endpoint's (`sampling_options`)."""
    for name, ok, what in (("format", lambda v: v == "", "text replies only"),
                           ("think", lambda v: v is False, "this model does not think aloud"),
                           ("images", lambda v: v == [], "this model reads text only"),
                           ("logprobs", lambda v: v is False, "no log probabilities"),
                           ("top_logprobs", lambda v: v == 0, "no log probabilities"),
                           ("tools", lambda v: v == [], "no tool calls"),
                           ("suffix", lambda v: v == "", "no insertion"),
                           ("template", lambda v: v == "", "the model's own chat template"),
                           ("context", lambda v: v == [], "send the conversation to /api/chat")):
        _refuse(body, name, ok, what)
    options = body.get("options")
    if options is None:
        return sampling_options({}, max_tokens)
    if not isinstance(options, dict):
        raise _invalid("options", "must be an object")
    known = ("num_predict", *OPTIONS, *ALIASES, *OLLAMA_RUNTIME, *(n for n, _, _ in OLLAMA_OFF))
    for name in options:
        if name not in known:
            raise APIError(400, unknown_option(name, known), param=name, code="invalid_value")
    for name, ok, what in OLLAMA_OFF:
        _refuse(options, name, ok, what)
    if isinstance(options.get("num_predict"), int) and options["num_predict"] in (-1, -2):
        options = {**options, "num_predict": None}
    return sampling_options(options, max_tokens, renames={"num_predict": "max_tokens"})


def ollama_messages(body: dict) -> list[dict]:
    """An /api/chat request's messages as the chat template takes them (an empty list: none, for
    ollama's request that loads the model)."""
    messages = body.get("messages")
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise _invalid("messages", "must be a list of messages")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            _refuse(m, "images", lambda v: v == [], "this model reads text only")
            _refuse(m, "tool_calls", lambda v: v == [], "no tool calls")
        out.append(_message(f"messages[{i}]", m, ("text",)))
    return out


# -- the engine --------------------------------------------------------------------------------

class Job:
    """One request's generation (or, with `work`, that call's result: an embedding). The
    worker thread runs it and puts its items (Responses, then an exception or None at the end)
    where the request's coroutine awaits them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ids: list[int], options: dict,
                 work: Callable[[], object] | None = None):
        self.ids, self.options, self.work = ids, options, work
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:           # the loop has closed (the server is stopping)
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """The loop that runs jobs one at a time, in order, and the bounded queue before it.

    `run` in the thread that ran the model before (the CLI's main thread, which loaded it): the
    CPU kernels' OpenMP threads belong to the first thread that ran a parallel kernel, and a
    second thread's kernels start their threads several times slower. `start` runs it in a
    thread of its own, for a model that has not run yet."""

    def __init__(self, llm, max_queue: int):
        self.llm, self.max_queue = llm, max_queue
        self._jobs: deque[Job] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self.running = False                     # a job is being run

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    def check_room(self) -> None:
        """503 when the queue is full (or the engine stopped)."""
        if self._closed:
            raise APIError(503, "the server is stopping", code="server_stopping")
        if len(self._jobs) + self.running > self.max_queue:     # (one runs, the rest wait)
            raise APIError(503, f"the server is busy: {len(self._jobs)} requests are waiting "
                                "(the most it queues); try again shortly", code="server_busy")

    def submit(self, job: Job) -> None:
        with self._ready:
            self.check_room()
            self._jobs.append(job)
            self._ready.notify()

    def cancel(self, job: Job) -> None:
        """The job's client has gone: it stops before its next token, or leaves the queue."""
        job.cancel()
        with self._ready:
            if job in self._jobs:
                self._jobs.remove(job)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="tinyrt-engine", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Cancel what runs and waits; `run` returns after the current token."""
        with self._ready:
            self._closed = True
            for job in self._jobs:
                job.put(APIError(503, "the server is stopping", code="server_stopping"))
            self._jobs.clear()
            self._ready.notify()

    def run(self) -> None:
        """Run jobs until `close`."""
        while True:
            with self._ready:
                while not self._jobs and not self._closed:
                    # (a timeout: Ctrl-C may reach another of the process's threads, and this
                    # one sees it only once it wakes)
                    self._ready.wait(timeout=0.2)
                if self._closed:
                    return
                job = self._jobs.popleft()
                self.running = True
            try:
                if not job.cancelled.is_set():
                    self._serve(job)
            finally:
                with self._ready:
                    self.running = False

    def _serve(self, job: Job) -> None:
        replies = None
        try:
            if job.work is not None:
                job.put(job.work())
                job.put(None)
                return
            replies = iter(self.llm.complete(job.ids, **job.options))
            for r in replies:
                # a client that stopped reading a stream (its socket's buffers full) is let go
                # once MAX_BACKLOG tokens wait for it
                if job.cancelled.is_set() or self._closed or job.items.qsize() > MAX_BACKLOG:
                    break
                job.put(r)
            job.put(None)
        except TinyrtError as e:
            job.put(APIError(400, str(e)))
        except Exception as e:                                # a bug: say so, keep serving
            traceback.print_exc(file=sys.stderr)
            job.put(APIError(500, f"internal error: {type(e).__name__}: {e}"))
        except BaseException:                                 # Ctrl-C: the server stops
            job.put(APIError(503, "the server is stopping", code="server_stopping"))
            raise
        finally:
            if replies is not None:
                replies.close()                  # the cache settles (LLM.complete)


# -- the app -----------------------------------------------------------------------------------

def _stderr(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):       # (stderr closed: the log goes, the request is answered)
        pass


class Server:
    """The app's state: the LLM, its name in the API and its other names (`aliases`), the key
    (None: no key), the most requests that wait and the largest body in bytes; whether a
    request for another model is refused (`strict_model`; else any name is the served model,
    as llama-server takes it); where each request's log line goes (None: nowhere); and the
    engine, which whoever serves the app runs (`Engine.run` or `start`; the app closes it when
    it stops)."""

    def __init__(self, llm, name: str, *, api_key: str | None, max_queue: int, max_body: int,
                 aliases=(), strict_model: bool = False,
                 log: Callable[[str], None] | None = _stderr):
        self.llm, self.name = llm, name
        # as bytes: a key given on the command line may hold bytes that are not UTF-8
        # (surrogate-escaped), which a client sends as they are
        self.api_key = None if api_key is None else os.fsencode(api_key)
        self.names = {name, *aliases}
        self.strict_model, self.log = strict_model, log
        self.max_body = max_body
        self.created = int(time.time())
        self.template, self.template_stops = conversation_template(llm)
        self.engine = Engine(llm, max_queue)

    def app(self):
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/responses", self.responses, methods=["POST"]),
                  Route("/", self.root, methods=["GET", "HEAD"]),
                  Route("/api/version", self.ollama_version, methods=["GET"]),
                  Route("/api/ps", self.ollama_ps, methods=["GET"]),
                  Route("/api/pull", self.ollama_pull, methods=["POST"]),
                  Route("/api/embed", self.ollama_embed, methods=["POST"]),
                  Route("/api/tags", self.ollama_tags, methods=["GET"]),
                  Route("/api/show", self.ollama_show, methods=["POST"]),
                  Route("/api/chat", self.ollama_chat, methods=["POST"]),
                  Route("/api/generate", self.ollama_generate, methods=["POST"])]
        app = Starlette(routes=routes, lifespan=self._lifespan,
                        exception_handlers={APIError: self._error, 404: self._not_found,
                                            405: self._not_allowed, Exception: self._bug,
                                            ClientDisconnect: self._gone})
        return app if self.log is None else RequestLog(app, self.log)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        try:
            yield
        finally:
            self.engine.close()

    # -- plain endpoints ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSON({"status": "ok", "model": self.name, "running": self.engine.running,
                             "waiting": self.engine.waiting})

    def _model_object(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "tinyrt"}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSON({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        # (asked about one model by name, the server says whether it has it, strict or not)
        self._authorize(request)
        self._check_model(request.path_params["model"], strict=True)
        return JSON(self._model_object())

    async def _error(self, request: Request, exc: APIError) -> Response:
        return exc.response(_speaks_ollama(request))

    async def _gone(self, request: Request, exc: ClientDisconnect) -> Response:
        # a client that went away while it sent its body (a slow or cancelled upload) is no
        # fault of the server's: nothing to log (as starlette's default handler, the
        # exception's traceback, once for each), and no one to answer
        return Response(status_code=499)

    async def _bug(self, request: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response(
            _speaks_ollama(request))

    async def _not_found(self, request: Request, exc) -> Response:
        return APIError(404, f"no such endpoint: {request.method} {request.url.path}",
                        code="not_found").response(_speaks_ollama(request))

    async def _not_allowed(self, request: Request, exc) -> Response:
        e = APIError(405, f"{request.method} is not allowed on {request.url.path}")
        return e.response(_speaks_ollama(request))

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        # (a header's bytes, as starlette decodes them: Latin-1)
        auth = request.headers.get("authorization", "").encode("latin-1")
        scheme, _, key = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           code="invalid_api_key")

    def _check_model(self, name, strict: bool = False, field: str = "model") -> None:
        """A model name a request gives (in `field`): any string, or with `strict_model` (or
        `strict`) one of the served model's names, with or without ollama's default tag
        (':latest')."""
        if name is not None and not isinstance(name, str):
            raise _invalid(field, "must be a string")
        if name is None or not (strict or self.strict_model):
            return
        if name not in self.names and name.removesuffix(":latest") not in self.names:
            raise APIError(404, f"the model {name!r} does not exist; this server has "
                                f"{self.name!r}", param="model", code="model_not_found")

    async def _body(self, request: Request) -> dict:
        # a body over the limit is read to its end (and dropped) before the 413, up to DRAIN
        # bytes: a client gets its answer rather than a broken pipe while it still sends
        length = request.headers.get("content-length", "")
        # (ASCII digits only: str.isdigit takes '²', which int() refuses; 19 digits are over
        # DRAIN already, and int() refuses over 4,300)
        digits = length.isascii() and length.isdigit()
        size, data = int(length[:19]) if digits else 0, bytearray()
        if size <= DRAIN:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size <= self.max_body:
                    data += chunk
                elif size > DRAIN:
                    break
        if size > self.max_body:
            raise APIError(413, f"the request body is over {self.max_body:,} bytes, the most "
                                "this server takes", code="body_too_large")
        try:
            body = json.loads(data, parse_constant=_no_constant, parse_int=_json_int)
        except _BadNumber as e:
            raise APIError(400, str(e), code="invalid_value") from None
        except (ValueError, RecursionError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        self._check_model(body.get("model"))
        _flag(body, "stream")
        if not isinstance(body.get("stream_options") or {}, dict):
            raise _invalid("stream_options", "must be an object")
        return body

    # -- completions ----------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        self._authorize(request)
        self.engine.check_room()                     # (before reading and tokenizing a body)
        body = await self._body(request)
        options = sampling_options(body, self.llm.cache.capacity)
        if chat:
            ids = await self._chat_ids(chat_messages(body), options)
        else:
            ids = await run_in_threadpool(self._prompt_ids, body.get("prompt"))
        started = await self._start(request, ids, options, "messages" if chat else "prompt")
        if started is None:                            # the client went away
            return Response(status_code=499)
        first, items = started
        reply = Reply(self.name, chat, len(ids))
        if body.get("stream", False):
            usage = (body.get("stream_options") or {}).get("include_usage") is True
            return StreamingResponse(reply.events(first, items, usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSON(reply.whole(*await _whole(first, items)))

    async def responses(self, request: Request) -> Response:
        """The Responses API (POST /v1/responses): text in, text out, whole or streamed."""
        self._authorize(request)
        self.engine.check_room()
        body = await self._body(request)
        options = responses_options(body, self.llm.cache.capacity)
        ids = await self._chat_ids(response_messages(body), options)
        started = await self._start(request, ids, options, "input")
        if started is None:
            return Response(status_code=499)
        first, items = started
        reply = ResponsesReply(self.name, body, len(ids))
        if body.get("stream", False):
            return StreamingResponse(reply.events(first, items), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSON(reply.whole(*await _whole(first, items)))

    async def _chat_ids(self, messages: list[dict], options: dict) -> list[int]:
        """The conversation's token ids; `options` get the stop strings its template needs."""
        try:
            options["stop"] = with_template_stops(options.get("stop"), self.template_stops)
        except SettingError as e:
            raise APIError(400, str(e), param="stop", code="invalid_value") from None
        return await run_in_threadpool(self._render, messages, options["max_tokens"])

    async def _start(self, request: Request, ids: list[int], options: dict, param: str):
        """The generation of `ids` queued, and its first Response awaited (a refusal is a
        status, not a stream): (first, the rest), or None when the client went away."""
        if not self.llm.cache.holds(len(ids)):
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server's context holds "
                                f"{self.llm.cache.capacity}", param=param,
                           code="context_length_exceeded")
        job = Job(asyncio.get_running_loop(), ids, options)
        self.engine.submit(job)
        request.scope[TOKENS] = counts = [len(ids), 0]
        items = _items(request, job, self.engine, counts)
        first = await anext(items, None)
        return None if first is None else (first, items)

    def _render(self, messages: list[dict], reserve: int) -> list[int]:
        """The conversation's tokens; where they fill the cache, its oldest turns left out
        (as ollama truncates a chat to its context) so that `reserve` slots stay for the reply,
        up to half the cache."""
        try:
            return fit_turns(functools.partial(conversation_ids, self.llm, self.template),
                             messages, self.llm.cache, reserve)[0]
        except TinyrtError as e:
            raise APIError(400, str(e), param="messages") from None

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(
                isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            vocab = self.llm.config.vocab_size
            if not all(0 <= i < vocab for i in prompt):
                raise _invalid("prompt", f"token ids must be in [0, {vocab})")
            return list(prompt)
        if not isinstance(prompt, str) or not prompt:
            raise _invalid("prompt", "must be a non-empty string, a list of one string, or a "
                                     "list of token ids")
        try:
            return self.llm.prompt_ids(_text("prompt", prompt), raw=True)
        except TinyrtError as e:
            raise APIError(400, str(e), param="prompt") from None

    # -- ollama's API ---------------------------------------------------------------------------

    async def ollama_version(self, request: Request) -> Response:
        from tinyrt import __version__

        return JSON({"version": __version__})

    def _ollama_details(self) -> dict:
        cfg = self.llm.config
        family = cfg.model_type or ""
        n = cfg.n_params
        # (the type most of the layers' projections are stored as: Q4_1, AWQ, F16)
        stored = {}
        for kind, counts in self.llm.model.weights.stored_kinds().items():
            if kind not in ("model.embed_tokens", "lm_head"):
                for t, k in counts.items():
                    stored[t] = stored.get(t, 0) + k
        return {"parent_model": "", "format": "gguf" if self.llm.directory.is_file()
                else "safetensors", "family": family, "families": [family] if family else None,
                "parameter_size": f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M",
                "quantization_level": max(stored, key=stored.get) if stored else ""}

    def _ollama_files(self) -> tuple[int, float]:
        """The model's files' bytes and their latest change (a file's or a directory's)."""
        path = self.llm.directory
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        stats = [f.stat() for f in files]
        return sum(st.st_size for st in stats), max((st.st_mtime for st in stats),
                                                   default=path.stat().st_mtime)

    def _ollama_model(self) -> dict:
        """The served model as ollama's lists give one (/api/tags, /api/ps)."""
        size, mtime = self._ollama_files()
        # (an ollama digest is its manifest's hash; here one of what tells this model apart)
        digest = hashlib.sha256(f"{self.name}\0{size}\0{mtime}".encode(
            "utf-8", "surrogatepass")).hexdigest()       # (a name of undecodable bytes)
        return {"name": self.name, "model": self.name, "modified_at": _ollama_time(mtime),
                "size": size, "digest": digest, "details": self._ollama_details()}

    async def root(self, request: Request) -> Response:
        # (what ollama answers at its root, which clients probe before they use it)
        return PlainTextResponse("tinyrt is running (ollama's API under /api, OpenAI's under "
                                 "/v1)")

    async def ollama_tags(self, request: Request) -> Response:
        self._authorize(request)
        return JSON({"models": [self._ollama_model()]})

    async def ollama_ps(self, request: Request) -> Response:
        """The loaded model: this server's one, loaded for as long as it runs (no expiry); its
        weights in GPU memory where it runs on one (size_vram)."""
        self._authorize(request)
        model = self._ollama_model()
        gpu = not getattr(self.llm.backend, "host_memory", True)
        return JSON({"models": [{**model, "expires_at": None,
                                 "size_vram": model["size"] if gpu else 0,
                                 "context_length": self.llm.cache.capacity}]})

    async def ollama_embed(self, request: Request) -> Response:
        """ollama's /api/embed: `input` a string or a list of strings, each embedded as
        `LLM.embed` does (one job of the queue: the model runs one thing at a time)."""
        start = time.perf_counter()
        self._authorize(request)
        self.engine.check_room()
        body = await self._body(request)
        given = body.get("input")
        texts = [given] if isinstance(given, str) else given
        if not isinstance(texts, list) or not texts or len(texts) > MAX_EMBED_INPUTS or \
                not all(isinstance(t, str) and t for t in texts):
            raise _invalid("input", f"must be a non-empty string or a list of 1 to "
                                    f"{MAX_EMBED_INPUTS} of them")
        truncate = _flag(body, "truncate", True)
        counts = []

        def work():
            vectors = []
            for t in texts:
                counts.append(min(len(self.llm.encode(t, add_special=True, what="the input")),
                                  self.llm.cache.capacity))
                vectors.append(self.llm.embed(t, truncate=truncate).tolist())
            return vectors

        job = Job(asyncio.get_running_loop(), [], {}, work)
        self.engine.submit(job)
        vectors = await job.items.get()
        if isinstance(vectors, Exception):
            raise vectors
        return JSON({"model": self.name, "embeddings": vectors,
                     "total_duration": _ns(time.perf_counter() - start), "load_duration": 0,
                     "prompt_eval_count": sum(counts)})

    async def ollama_pull(self, request: Request) -> Response:
        """ollama's pull of the model this server runs: it is here already, so its status lines
        end at once in success; another model is refused (one model a server: `tinyrt pull`
        fetches it for another)."""
        self._authorize(request)
        body = await self._body(request)
        name = body.get("model", body.get("name"))
        if not isinstance(name, str):
            raise _invalid("model", "must be the name of the model to pull")
        self._check_model(name, strict=True)
        lines = [{"status": "pulling manifest"}, {"status": "verifying sha256 digest"},
                 {"status": "success"}]
        if body.get("stream", True) is False:
            return JSON(lines[-1])
        return Response(b"".join(map(_ndjson, lines)), media_type="application/x-ndjson")

    async def ollama_show(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._body(request)
        self._check_model(body.get("name"), field="name")     # (older clients' name for it)
        details, cfg = self._ollama_details(), self.llm.config.to_dict()
        family = details["family"] or "model"
        info = {"general.architecture": family}
        for key, field in (("context_length", "max_position_embeddings"),
                           ("embedding_length", "hidden_size"),
                           ("block_count", "num_hidden_layers"), ("vocab_size", "vocab_size")):
            if isinstance(cfg.get(field), int):
                info[f"{family}.{key}"] = cfg[field]
        stops = "".join(f"stop {json.dumps(s)}\n" for s in self.template_stops)
        return JSON({"modelfile": f"FROM {self.name}\n", "template": self.template.source,
                             "parameters": f"num_ctx {self.llm.cache.capacity}\n{stops}",
                             "details": details, "model_info": info,
                             "capabilities": ["completion"],
                             "modified_at": _ollama_time(self._ollama_files()[1])})

    async def ollama_chat(self, request: Request) -> Response:
        return await self._ollama_generation(request, chat=True)

    async def ollama_generate(self, request: Request) -> Response:
        return await self._ollama_generation(request, chat=False)

    async def _ollama_generation(self, request: Request, *, chat: bool) -> Response:
        """/api/chat and /api/generate: NDJSON lines unless "stream": false (ollama's default is
        to stream); a request with nothing to say (no messages, no prompt) only loads the
        model, which is loaded already."""
        start = time.perf_counter()
        self._authorize(request)
        self.engine.check_room()
        body = await self._body(request)
        options = ollama_options(body, self.llm.cache.capacity)
        reply = OllamaReply(self.name, chat, start)
        stream = body.get("stream", True)
        if chat:
            messages = ollama_messages(body)
            if not messages:
                return reply.loaded(stream)
            ids = await self._chat_ids(messages, options)
        else:
            prompt, system, raw = body.get("prompt"), body.get("system"), _flag(body, "raw")
            if prompt is not None and not isinstance(prompt, str):
                raise _invalid("prompt", "must be a string")
            if system is not None and not isinstance(system, str):
                raise _invalid("system", "must be a string")
            if not prompt:
                return reply.loaded(stream)
            if raw:
                if system:
                    raise _invalid("system", "has no place in a raw prompt")
                ids = await run_in_threadpool(self._prompt_ids, prompt)
            else:
                messages = [{"role": "system", "content": _text("system", system)}] \
                    if system else []
                messages.append({"role": "user", "content": _text("prompt", prompt)})
                ids = await self._chat_ids(messages, options)
        started = await self._start(request, ids, options, "messages" if chat else "prompt")
        if started is None:
            return Response(status_code=499)
        first, items = started
        reply.prompt_tokens = len(ids)
        if stream:
            return StreamingResponse(reply.lines(first, items), media_type="application/x-ndjson")
        return JSON(reply.final(*await _whole(first, items)))


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class _BadNumber(ValueError):
    """A JSON integer longer than Python converts (4,300 digits)."""


def _json_int(text: str) -> int:
    # (a number of thousands of digits is valid JSON, and out of every field's range: its
    # field's check refuses it by name where Python converts it, and here where it does not)
    try:
        return int(text)
    except ValueError:
        raise _BadNumber(f"the request body has an integer of {len(text):,} digits, "
                         "more than any field takes") from None


def json_bytes(obj) -> bytes:
    """The one encoding of the server's JSON, whole or streamed: UTF-8, always valid JSON. A
    float that is not finite (a division by a zero time) is null; a lone surrogate (a name
    from undecodable bytes: a model folder's, an alias given on the command line; a chat
    template's) is U+FFFD."""
    text = json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return SURROGATE.sub("\ufffd", text).encode()


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class JSON(JSONResponse):
    """starlette's JSONResponse, encoded by `json_bytes`."""

    def render(self, content) -> bytes:
        return json_bytes(content)


async def _items(request: Request, job: Job, engine: Engine, counts: list[int]) -> AsyncIterator:
    """The job's Responses as the worker makes them; ends early (and cancels the job) when the
    client goes away; an APIError from the worker is raised. `counts[1]` follows the tokens
    generated (the request's log line)."""
    gone = asyncio.ensure_future(_disconnect(request))
    get = None
    try:
        while True:
            get = asyncio.ensure_future(job.items.get())
            await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                return
            item = get.result()
            if item is None:
                return
            if isinstance(item, APIError):
                raise item
            counts[1] = item.timings.generated_tokens
            yield item
    finally:
        engine.cancel(job)
        gone.cancel()
        if get is not None:
            get.cancel()


async def _all(first, items: AsyncIterator) -> AsyncIterator:
    yield first
    async for r in items:
        yield r


async def _whole(first, items: AsyncIterator) -> tuple[str, object]:
    """A generation's whole text and its last Response."""
    text, last = [], first
    async for r in _all(first, items):
        text.append(r.text)
        last = r
    return "".join(text), last


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Reply:
    """A completion's JSON: whole, or as server-sent event chunks."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int):
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self, last) -> dict:
        t = last.timings
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": t.generated_tokens,
                "total_tokens": self.prompt_tokens + t.generated_tokens,
                "prompt_tokens_details": {"cached_tokens": t.cached_tokens}}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def whole(self, text: str, last) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": last.finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": self.usage(last)}

    def _chunk(self, text: str | None, finish: str | None, role: bool = False) -> bytes:
        if self.chat:
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            chunk = {**self._head("text_completion"), "choices": [choice]}
        return _event(chunk)

    async def events(self, first, items: AsyncIterator, usage: bool) -> AsyncIterator[bytes]:
        if self.chat:
            yield self._chunk(None, None, role=True)
        last = None
        try:
            r = first
            while True:
                last = r
                if r.finish_reason is not None:
                    if r.text:
                        yield self._chunk(r.text, None)
                    yield self._chunk(None, r.finish_reason)
                elif r.text:
                    yield self._chunk(r.text, None)
                r = await anext(items, None)
                if r is None:
                    break
        except APIError as e:                  # after the headers: the error as an event
            yield _event(e.body())
        if usage and last is not None and last.finish_reason is not None:
            obj = "chat.completion.chunk" if self.chat else self.object
            yield _event({**self._head(obj), "choices": [], "usage": self.usage(last)})
        yield b"data: [DONE]\n\n"


def _event(obj: dict) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def _speaks_ollama(request: Request) -> bool:
    return request.url.path.startswith("/api/")


# -- the log -----------------------------------------------------------------------------------

class RequestLog:
    """ASGI middleware: one line for each HTTP request once it is answered (a stream once it
    ends): method, path, status, the prompt's and the reply's tokens where it generated, and
    its time, as `POST /v1/chat/completions 200 12+34 tokens 812 ms`. (`tinyrt serve` turns
    uvicorn's own access log off: this is the one line.)"""

    def __init__(self, app, write: Callable[[str], None]):
        self.app, self.write = app, write

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            tokens = scope.get(TOKENS)
            used = f" {tokens[0]}+{tokens[1]} tokens" if tokens else ""
            # (a path is percent-decoded: escaped, a newline in one cannot start a line)
            path = scope["path"].encode("unicode_escape").decode("ascii")
            ms = (time.perf_counter() - start) * 1000
            self.write(f"{scope['method']} {path} {status[0] if status else 500}{used} {ms:.0f} ms")


# -- the Responses API's replies ---------------------------------------------------------------

class ResponsesReply:
    """A Responses API response: whole, or as the stream of typed events the API sends
    (response.created, the message's output item and text part opened, its text deltas, both
    closed, response.completed)."""

    def __init__(self, model: str, body: dict, prompt_tokens: int):
        self.model, self.prompt_tokens = model, prompt_tokens
        self.id, self.item_id = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.asked = {k: body.get(k) for k in ("instructions", "max_output_tokens",
                                               "temperature", "top_p")}
        self.metadata = body.get("metadata") or {}        # (responses_options checked it)
        self.sequence = 0

    def usage(self, last) -> dict:
        t = last.timings
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": t.cached_tokens},
                "output_tokens": t.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + t.generated_tokens}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, text: str | None = None) -> dict:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": [] if text is None else [self._part(text)]}

    def _response(self, status: str, output: list, last=None, error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                **self.asked, "model": self.model, "output": output,
                "parallel_tool_calls": False, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
                "truncation": "disabled", "usage": None if last is None else self.usage(last),
                "user": None, "metadata": self.metadata}

    @staticmethod
    def _status(last) -> str:
        return "incomplete" if last.finish_reason == "length" else "completed"

    def whole(self, text: str, last) -> dict:
        status = self._status(last)
        return self._response(status, [self._item(status, text)], last)

    def _event(self, kind: str, **fields) -> bytes:
        self.sequence += 1
        obj = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\n".encode() + _event(obj)

    async def events(self, first, items: AsyncIterator) -> AsyncIterator[bytes]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        yield self._event("response.output_item.added", output_index=0,
                          item=self._item("in_progress"))
        yield self._event("response.content_part.added", **where, part=self._part(""))
        text, last = [], first
        try:
            async for r in _all(first, items):
                last = r
                if r.text:
                    text.append(r.text)
                    yield self._event("response.output_text.delta", **where, delta=r.text,
                                      logprobs=[])
        except APIError as e:                  # after the headers: the error as events
            yield self._event("error", code=e.code, message=e.message, param=e.param)
            error = {"code": e.code or "server_error", "message": e.message}
            yield self._event("response.failed", response=self._response("failed", [], None,
                                                                         error))
            return
        whole, status = "".join(text), self._status(last)
        yield self._event("response.output_text.done", **where, text=whole, logprobs=[])
        yield self._event("response.content_part.done", **where, part=self._part(whole))
        yield self._event("response.output_item.done", output_index=0,
                          item=self._item(status, whole))
        yield self._event(f"response.{status}",
                          response=self._response(status, [self._item(status, whole)], last))


# -- ollama's replies --------------------------------------------------------------------------

def _ollama_time(seconds: float | None = None) -> str:
    """A time as ollama writes one (RFC 3339, UTC): now, or `seconds` since the epoch."""
    t = datetime.now(timezone.utc) if seconds is None else \
        datetime.fromtimestamp(seconds, timezone.utc)
    return t.isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


class OllamaReply:
    """An ollama /api/chat or /api/generate reply: whole, or as NDJSON lines, the last with
    done, done_reason and the counts and durations (nanoseconds)."""

    def __init__(self, model: str, chat: bool, start: float):
        self.model, self.chat, self.start = model, chat, start
        self.prompt_tokens = 0

    def _line(self, text: str, done: bool) -> dict:
        said = {"message": {"role": "assistant", "content": text}} if self.chat else \
            {"response": text}
        return {"model": self.model, "created_at": _ollama_time(), **said, "done": done}

    def final(self, text: str, last) -> dict:
        t = last.timings
        return {**self._line(text, True), "done_reason": last.finish_reason or "stop",
                "total_duration": _ns(time.perf_counter() - self.start), "load_duration": 0,
                "prompt_eval_count": self.prompt_tokens, "prompt_eval_duration": _ns(t.prefill_s),
                "eval_count": t.generated_tokens,
                "eval_duration": _ns(max(t.ttft_s - t.prefill_s, 0.0) + t.decode_s)}

    def loaded(self, stream: bool) -> Response:
        line = {**self._line("", True), "done_reason": "load"}
        if stream:
            return Response(_ndjson(line), media_type="application/x-ndjson")
        return JSON(line)

    async def lines(self, first, items: AsyncIterator) -> AsyncIterator[bytes]:
        last = first
        try:
            async for r in _all(first, items):
                last = r
                if r.text:
                    yield _ndjson(self._line(r.text, False))
        except APIError as e:                  # after the headers: the error as a line
            yield _ndjson({"error": e.message})
            return
        yield _ndjson(self.final("", last))


def _ndjson(obj: dict) -> bytes:
    return json_bytes(obj) + b"\n"
