"""`tinyrt serve`: an OpenAI-compatible HTTP API over one loaded `LLM` (an ASGI app on starlette).

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events or
whole), GET /v1/models, /v1/models/{id} and /health. Requests and responses have OpenAI's
shapes; errors are OpenAI's error object with the status its meaning takes (400 a bad body or
field, 401 a missing or wrong key, 404 an unknown model, 413 a body over the limit, 503 a full
queue).

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
import hmac
import json
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tinyrt.errors import TinyrtError

from .chat import conversation_template, with_template_stops
from .sampling import ALIASES, OPTIONS, SettingError, check_settings

DRAIN = 64 << 20
MAX_BACKLOG = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")


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

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# -- requests ----------------------------------------------------------------------------------

def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}' {message}", param=param, code="invalid_value")


def _refuse(body: dict, name: str, ok, what: str) -> None:
    """A 400 for an OpenAI field this server does not do, unless it has a value that asks for
    nothing (`ok(value)`)."""
    if name in body and body[name] is not None and not ok(body[name]):
        raise _invalid(name, f"is not supported by this server ({what})")


def sampling_options(body: dict, max_tokens: int) -> dict:
    """`LLM.complete` options from OpenAI's fields (and llama.cpp's extras: top_k, min_p,
    repeat_penalty, ignore_eos; and the other runtimes' names, sampling.ALIASES), checked as
    every front end's (sampling.check_settings; seed -1 is a random seed, as llama.cpp has it).
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


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if not isinstance(v, bool):
        raise _invalid(name, "must be true or false")
    return v


def chat_messages(body: dict) -> list[dict]:
    """The request's messages as the chat template takes them: string contents (text parts
    joined), a developer message as a system message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _invalid(where, f"must be an object with a 'role' of {', '.join(ROLES)}")
        content = m.get("content")
        if content is None and m["role"] == "assistant":
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise _invalid(where, "content parts must be text parts ({'type': 'text', "
                                      "'text': ...}); this model reads text only")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise _invalid(where, "needs a string 'content'")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text(where, content)})
    return out


# -- the engine --------------------------------------------------------------------------------

class Job:
    """One request's generation. The worker thread runs it and puts its items (Responses, then
    an exception or None at the end) where the request's coroutine awaits them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ids: list[int], options: dict):
        self.ids, self.options = ids, options
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

class Server:
    """The app's state: the LLM, its name in the API, the key (None: no key), the most requests
    that wait and the largest body in bytes; and the engine, which whoever serves the app runs
    (`Engine.run` or `start`; the app closes it when it stops)."""

    def __init__(self, llm, name: str, *, api_key: str | None, max_queue: int, max_body: int):
        self.llm, self.name, self.api_key = llm, name, api_key
        self.max_body = max_body
        self.created = int(time.time())
        self.template, self.template_stops = conversation_template(llm)
        self.engine = Engine(llm, max_queue)

    def app(self) -> Starlette:
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        return Starlette(routes=routes, lifespan=self._lifespan,
                         exception_handlers={APIError: self._error, 404: self._not_found,
                                             405: self._not_allowed, Exception: self._bug,
                                             ClientDisconnect: self._gone})

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        try:
            yield
        finally:
            self.engine.close()

    # -- plain endpoints ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.name, "running": self.engine.running,
                             "waiting": self.engine.waiting})

    def _model_object(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "tinyrt"}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_object())

    async def _error(self, request: Request, exc: APIError) -> Response:
        return exc.response()

    async def _gone(self, request: Request, exc: ClientDisconnect) -> Response:
        # a client that went away while it sent its body (a slow or cancelled upload) is no
        # fault of the server's: nothing to log (as starlette's default handler, the
        # exception's traceback, once for each), and no one to answer
        return Response(status_code=499)

    async def _bug(self, request: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    async def _not_found(self, request: Request, exc) -> Response:
        return APIError(404, f"no such endpoint: {request.method} {request.url.path}",
                        code="not_found").response()

    async def _not_allowed(self, request: Request, exc) -> Response:
        e = APIError(405, f"{request.method} is not allowed on {request.url.path}")
        return JSONResponse(e.body(), status_code=405)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           code="invalid_api_key")

    def _check_model(self, name) -> None:
        if name is not None and not isinstance(name, str):
            raise _invalid("model", "must be a string")
        if name is not None and name != self.name:
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
        except _LongInteger as e:
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
            messages = chat_messages(body)
            try:
                options["stop"] = with_template_stops(options.get("stop"), self.template_stops)
            except SettingError as e:
                raise APIError(400, str(e), param="stop", code="invalid_value") from None
            ids = await run_in_threadpool(self._chat_ids, messages)
        else:
            ids = await run_in_threadpool(self._prompt_ids, body.get("prompt"))
        if not self.llm.cache.holds(len(ids)):
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server's context holds "
                                f"{self.llm.cache.capacity}", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        job = Job(asyncio.get_running_loop(), ids, options)
        self.engine.submit(job)
        items = _items(request, job, self.engine)
        first = await anext(items, None)             # a refusal is a status, not a stream
        if first is None:                              # the client went away
            return Response(status_code=499)
        reply = Reply(self.name, chat, len(ids))
        if body.get("stream", False):
            usage = (body.get("stream_options") or {}).get("include_usage") is True
            return StreamingResponse(reply.events(first, items, usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, last = [first.text], first
        async for r in items:
            text.append(r.text)
            last = r
        return JSONResponse(reply.whole("".join(text), last))

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        try:
            text = self.template.render(messages, add_generation_prompt=True)
            return self.llm.encode(text, what="the conversation")
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


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class _LongInteger(ValueError):
    """A JSON integer longer than Python converts (4,300 digits)."""


def _json_int(text: str) -> int:
    # (a number of thousands of digits is valid JSON, and out of every field's range: its
    # field's check refuses it by name where Python converts it, and here where it does not)
    try:
        return int(text)
    except ValueError:
        raise _LongInteger(f"the request body has an integer of {len(text):,} digits, "
                           "more than any field takes") from None


async def _items(request: Request, job: Job, engine: Engine) -> AsyncIterator:
    """The job's Responses as the worker makes them; ends early (and cancels the job) when the
    client goes away; an APIError from the worker is raised."""
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
            yield item
    finally:
        engine.cancel(job)
        gone.cancel()
        if get is not None:
            get.cancel()


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
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
