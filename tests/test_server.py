"""`tinyrt serve`: the OpenAI-compatible server, run for real (uvicorn on a free localhost port)
and spoken to with the official `openai` client: chat and completions, whole and streamed, models,
auth, errors, the queue, cancelling mid-stream, and reusing the KV cache across turns."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

import tinyrt
from helpers import tiny_config, write_tiny_model
from tinyrt.cli.serve import MAX_BODY
from tinyrt.server import Server

KEY = "sesame"
HANG = 60          # seconds: a hang detector, not a speed check (a shared machine may stall)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "m", tiny_config(), seed=7)


class Running:
    """A Server on uvicorn in a thread, on a port the OS picked."""

    def __init__(self, llm, *, api_key=None, max_queue=8, max_body=MAX_BODY):
        self.llm = llm
        self.server = Server(llm, "tiny", api_key=api_key, max_queue=max_queue, max_body=max_body)
        self.server.engine.start()
        config = uvicorn.Config(self.server.app(), host="127.0.0.1", port=0, log_level="error")
        self.web = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.web.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.web.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.port = self.web.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none",
                                    max_retries=0, timeout=60)

    def health(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url + "/health", timeout=10).read())

    def idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (h := self.health())["running"] or h["waiting"]:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.01)

    def stop(self) -> None:
        self.web.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served(tiny):
    run = Running(tinyrt.LLM(tiny, device="reference", kv_size=256, kv_type="f32"))
    yield run
    run.stop()


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat_ids(llm, messages) -> list[int]:
    return llm.tokenizer.encode(llm.template.render(messages), add_special=False)


# -- what the client sees --------------------------------------------------------------------------

def test_models_and_health(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].object == "model"
    assert served.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("gpt-4o")
    assert served.health()["status"] == "ok"


def test_chat_is_the_api_s_reply_whole_and_streamed(served, tiny):
    """The server's replies are `LLM.complete`'s on the same token ids, after the same earlier
    requests (so with the same cache reuse): token for token, whole and streamed."""
    served.idle()
    served.llm.reset()
    reference = tinyrt.LLM(tiny, device="reference", kv_size=256, kv_type="f32")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    r = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                              temperature=0)
    want = list(reference.complete(chat_ids(reference, messages), max_tokens=12, temperature=0))
    text = "".join(x.text for x in want)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == want[-1].finish_reason
    assert r.usage.prompt_tokens == len(chat_ids(reference, messages))
    assert r.usage.completion_tokens == want[-1].timings.generated_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    messages[1]["content"] = [{"type": "text", "text": "What is the capital"},
                              {"type": "text", "text": " of Spain?"}]
    chunks = list(served.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    flat = dict(messages[1], content="What is the capital of Spain?")
    want = list(reference.complete(chat_ids(reference, [messages[0], flat]), max_tokens=12,
                                   temperature=0))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "".join(x.text for x in want)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want[-1].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        want[-1].timings.generated_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == want[-1].timings.cached_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completions_whole_streamed_and_from_token_ids(served):
    served.llm.reset()
    r = served.client.completions.create(model="tiny", prompt="def f(x):", max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    ids = served.llm.prompt_ids("def f(x):", raw=True)
    streamed = list(served.client.completions.create(model="tiny", prompt=ids, max_tokens=10,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    stop = r.choices[0].text[3:5]
    cut = served.client.completions.create(model="tiny", prompt="def f(x):", max_tokens=10,
                                           temperature=0, stop=[stop])
    assert cut.choices[0].text == r.choices[0].text[:r.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_sampling_fields_reach_the_sampler(served):
    """A seed gives the same sample again; penalties and llama.cpp's extras are taken, and act:
    the greedy reply under a strong frequency penalty holds more distinct tokens than the plain
    greedy reply of the same prompt, which repeats itself."""
    kw = dict(model="tiny", prompt="The", max_tokens=16, temperature=1.5, top_p=0.9, seed=11,
              presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"ignore_eos": True, "top_k": 0, "min_p": 0.0})
    a, b = (served.client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    texts = {served.client.completions.create(**dict(kw, seed=s)).choices[0].text
             for s in range(4)}
    assert len(texts) > 1

    def greedy_ids(**extra):
        text = served.client.completions.create(
            model="tiny", prompt="The", max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True}, **extra).choices[0].text
        return served.llm.tokenizer.encode(text)

    plain, penalized = greedy_ids(), greedy_ids(frequency_penalty=2.0)
    assert len(set(plain)) < len(plain)             # a tiny random model repeats itself
    assert len(set(penalized)) > len(set(plain)) and penalized != plain


def test_a_follow_up_turn_prefills_only_what_is_new(served):
    served.llm.reset()
    messages = [{"role": "user", "content": "café naïve def f(x):"}]
    first = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                                  temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
    second = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                                   temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # everything up to the reply's first token at least (a random model's reply need not come
    # out of the tokenizer as it was drawn), and most of the conversation
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    new = [{"role": "user", "content": "something else"}]
    other = served.client.chat.completions.create(model="tiny", messages=new, max_tokens=5)
    a, b = chat_ids(served.llm, messages), chat_ids(served.llm, new)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert other.usage.prompt_tokens_details.cached_tokens == common


# -- what the client is refused --------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("n", 2), ("temperature", -0.5), ("temperature", "hot"), ("top_k", 2.5), ("top_k", -1),
    ("min_p", 1.5), ("repeat_penalty", 0), ("seed", 2**64), ("seed", 1.5), ("stop", [""]), ("top_p", 0), ("max_tokens", 0),
    ("max_completion_tokens", -3), ("temp", -1), ("repetition_penalty", 0), ("seed", -2), ("stop", [1]), ("stop", ["a"] * 17),
    ("logprobs", True), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("response_format", {"type": "json_object"}), ("presence_penalty", 3), ("stream", "yes"),
    ("messages", []), ("messages", [{"role": "wizard", "content": "x"}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ("messages", [{"role": "user", "content": "\ud800"}]), ("stop", "\udfff"), ("model", 123),
    ("ignore_eos", "yes"), ("stream_options", 5),
])
def test_bad_fields_get_400_naming_the_field(served, field, value):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: value}
    status, err = post(served.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error" and field in err["error"]["param"]


@pytest.mark.parametrize("field,value", [("top_k", 2.5), ("seed", -2), ("temperature", -1),
                                         ("stop", [1, 2]), ("max_completion_tokens", 0),
                                         ("repetition_penalty", -1)])
def test_sampling_fields_are_checked_as_every_front_end_s(served, field, value):
    """The server's refusal is sampling.check_settings's own (one check for the CLI, the API,
    a saved chat and the server), the field named as the client sent it."""
    from tinyrt.sampling import SettingError, check_settings

    with pytest.raises(SettingError) as want:
        check_settings({field: value})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: value}
    status, err = post(served.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and err["error"]["param"] == field
    assert err["error"]["message"] == str(want.value)


def test_other_runtimes_names_are_taken(served):
    """mlx-lm's temp, HF's max_new_tokens and repetition_penalty (sampling.ALIASES) act as ours;
    OpenAI's max_completion_tokens wins over max_tokens."""
    ask = dict(model="tiny", prompt="The", seed=3)
    ours = served.client.completions.create(**ask, max_tokens=6, extra_body=dict(
        temperature=0.9, repeat_penalty=1.3, ignore_eos=True)).choices[0].text
    theirs = served.client.completions.create(**ask, max_tokens=2, extra_body=dict(
        temp=0.9, repetition_penalty=1.3, max_new_tokens=6, ignore_eos=True)).choices[0].text
    assert theirs == ours
    other = served.client.completions.create(**ask, max_tokens=6, extra_body=dict(
        temp=0.9, repetition_penalty=1.0, ignore_eos=True)).choices[0].text
    assert other != ours                            # (the penalty is not ignored)
    usage = served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        max_completion_tokens=5, extra_body=dict(ignore_eos=True)).usage
    assert usage.completion_tokens == 5


def test_edge_values_that_mean_something_are_taken(served):
    """seed -1 is a random seed (llama.cpp's meaning); a temperature below 1e-5 is greedy; a
    prompt far longer than the cache could hold is refused before it is tokenized."""
    kw = dict(model="tiny", prompt="The", max_tokens=8, extra_body={"ignore_eos": True})
    greedy = served.client.completions.create(**kw, temperature=0).choices[0].text
    tiny = served.client.completions.create(**kw, temperature=1e-300, seed=-1).choices[0].text
    assert tiny == greedy
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model="tiny", prompt="x" * 100_000, max_tokens=4)
    assert "KV cache of 256 tokens" in e.value.body["message"] and e.value.body["param"] == "prompt"


def test_errors_have_openai_s_shape_and_status(served):
    url = served.url + "/v1/chat/completions"
    for body in (b"{not json", b"[1, 2]", b'{"messages": NaN}', b"\xff\xfe"):
        status, err = post(url, body)
        assert status == 400 and err["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError) as e:
        served.client.chat.completions.create(model="llama-70b", messages=[
            {"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and "tiny" in e.value.body["message"]
    status, err = post(url, b'{"messages": [{"role": "user", "content": "' + b"x" * MAX_BODY + b'"}]}')
    assert status == 413 and err["error"]["code"] == "body_too_large"
    with pytest.raises(openai.BadRequestError) as e:   # the cache holds 256 tokens
        served.client.completions.create(model="tiny", prompt="def f(x): " * 200, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    assert re.search(r"the prompt has \d+ tokens; .* holds 256", e.value.body["message"])
    assert post(served.url + "/v1/embeddings", b"{}")[0] == 404
    assert served.client.completions.create(model="tiny", prompt="ok", max_tokens=2).usage


def test_api_key(tiny):
    run = Running(tinyrt.LLM(tiny, device="reference", kv_size=128), api_key=KEY)
    try:
        assert run.client.models.list().data[0].id == "tiny"
        for key in ("none", KEY + "x"):
            bad = openai.OpenAI(base_url=run.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        status, _ = post(run.url + "/v1/completions", b'{"prompt": "x"}')
        assert status == 401
        assert run.health()["status"] == "ok"        # (monitoring needs no key)
    finally:
        run.stop()


# -- one generation at a time ----------------------------------------------------------------------

def counting(llm) -> list[int]:
    """Counts the model's forward passes."""
    calls, forward = [0], llm.model.forward

    def counted(*a, **kw):
        calls[0] += 1
        return forward(*a, **kw)

    llm.model.forward = counted
    return calls


def test_cancelling_a_stream_stops_its_generation_and_the_next_request_runs(tiny):
    # a streaming cache and no end: the generation goes on until it is cancelled
    run = Running(tinyrt.LLM(tiny, device="reference", kv_size=64, kv_policy="sink"), max_queue=0)
    calls = counting(run.llm)
    try:
        long = dict(model="tiny", prompt="def f(x):", max_tokens=10**9, temperature=0,
                    stream=True, extra_body={"ignore_eos": True})
        stream = run.client.completions.create(**long)
        for _, _chunk in zip(range(3), stream):
            pass
        assert run.health()["running"]
        with pytest.raises(openai.APIStatusError) as e:          # no room in a queue of 0
            run.client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "server_busy"
        stream.close()
        seen = calls[0]
        run.idle()
        assert calls[0] - seen < 40, "the generation went on after the client left"
        r = run.client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    finally:
        run.stop()


def test_a_request_given_up_while_it_waits_never_runs(tiny):
    run = Running(tinyrt.LLM(tiny, device="reference", kv_size=64, kv_policy="sink"))
    ran, complete = [], run.llm.complete
    run.llm.complete = lambda ids, **kw: ran.append(ids) or complete(ids, **kw)
    try:
        stream = run.client.completions.create(model="tiny", prompt="def f(x):", stream=True,
                                               max_tokens=10**9, extra_body={"ignore_eos": True})
        next(iter(stream))
        impatient = run.client.with_options(timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="tiny", prompt="never", max_tokens=2)
        deadline = time.monotonic() + HANG             # it leaves the queue
        while run.health()["waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        stream.close()
        run.idle()
        assert len(ran) == 1
    finally:
        run.stop()


def test_a_client_that_stops_reading_is_let_go(tiny):
    run = Running(tinyrt.LLM(tiny, device="reference", kv_size=64, kv_policy="sink"))
    body = json.dumps({"model": "tiny", "prompt": "def f(x):", "stream": True, "ignore_eos": True,
                       "max_tokens": 10**9}).encode()
    try:
        with socket.create_connection(("127.0.0.1", run.port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + HANG
            while not run.health()["running"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            run.idle(timeout=120)              # (never read: its buffers fill, then the backlog)
        assert run.client.completions.create(model="tiny", prompt="x", max_tokens=2).usage
    finally:
        run.stop()


def test_requests_wait_their_turn_and_each_gets_its_own_reply(served):
    """Concurrent requests run one at a time, in order, each getting the reply it would alone."""
    served.idle()
    prompts = [f"def f{i}(x):" for i in range(5)]
    alone = {}
    for p in prompts:
        served.llm.reset()
        alone[p] = served.client.completions.create(model="tiny", prompt=p, max_tokens=8,
                                                    temperature=0).choices[0].text
    got, errors = {}, []

    def ask(p):
        try:
            got[p] = "".join(c.choices[0].text for c in served.client.completions.create(
                model="tiny", prompt=p, max_tokens=8, temperature=0, stream=True))
        except Exception as e:          # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and got == alone


def test_waiting_requests_run_in_the_order_they_arrived(served, monkeypatch):
    """First come, first served: the first request is held at its start while four more arrive,
    each sent only once the engine counts the one before it waiting (so the order of arrival is
    known, not raced); the model then runs them in that order. Each is told apart by its
    max_tokens."""
    served.idle()
    gate, order, errors = threading.Event(), [], []
    complete = served.llm.complete

    def held(ids, **options):
        order.append(options["max_tokens"])
        if len(order) == 1:
            gate.wait(timeout=60)
        return complete(ids, **options)

    def ask(n):
        try:
            served.client.completions.create(model="tiny", prompt="a b c", max_tokens=n,
                                             temperature=0)
        except Exception as e:          # (reported below)
            errors.append(e)

    monkeypatch.setattr(served.llm, "complete", held)
    engine, threads = served.server.engine, []
    for n in range(1, 6):
        threads.append(threading.Thread(target=ask, args=(n,)))
        threads[-1].start()
        deadline = time.monotonic() + HANG
        while len(order) < 1 or engine.waiting < n - 1:
            assert time.monotonic() < deadline and not errors, (order, engine.waiting, errors)
            time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join(timeout=60)
    assert not errors and order == [1, 2, 3, 4, 5]


# -- the command -----------------------------------------------------------------------------------

@pytest.mark.real_model
def test_tinyrt_serve_with_the_default_model(smol):
    """`tinyrt serve` on the default model: the greedy answer through the server is the API's,
    a follow-up turn prefills only its new tokens, and Ctrl-C stops it cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "tinyrt", "serve", str(smol), "--port", "0",
                             "--alias", "smol"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TINYRT_API_KEY": ""})
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "serving" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, line
            line = proc.stderr.readline()
        url = re.search(r"(http://\S+/v1)", line).group(1)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        llm = tinyrt.load(smol, quiet=True)
        question = "What is the capital of France?"
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=32,
                                           temperature=0)
        assert r.choices[0].message.content == llm.generate(question, max_tokens=32, temperature=0)
        assert "Paris" in r.choices[0].message.content
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "And of Italy?"}]
        follow = client.chat.completions.create(model="smol", messages=messages, max_tokens=16,
                                                temperature=0)
        new = follow.usage.prompt_tokens - follow.usage.prompt_tokens_details.cached_tokens
        assert follow.usage.prompt_tokens_details.cached_tokens == \
            r.usage.prompt_tokens + r.usage.completion_tokens and new < 16
        # Ctrl-C with one reply streaming and one request waiting: both are answered
        health = url[:-3] + "/health"
        results = {}

        def ask(name, **kw):
            try:
                for _ in client.completions.create(model="smol", stream=True, **kw):
                    pass
                results[name] = "done"
            except openai.APIError as e:
                results[name] = e

        def until(field, value):
            deadline = time.monotonic() + 30
            while json.loads(urllib.request.urlopen(health, timeout=10).read())[field] != value:
                assert time.monotonic() < deadline
                time.sleep(0.01)

        streaming = threading.Thread(target=ask, args=("long",), kwargs=dict(
            prompt="Once upon a time", max_tokens=3000, extra_body={"ignore_eos": True}))
        streaming.start()
        until("running", True)
        waiting = threading.Thread(target=ask, args=("queued",), kwargs=dict(prompt="x",
                                                                            max_tokens=2))
        waiting.start()
        until("waiting", 1)
        proc.send_signal(signal.SIGINT)
        waiting.join(timeout=HANG)
        streaming.join(timeout=HANG)
        assert not waiting.is_alive() and not streaming.is_alive()
        assert results["queued"].status_code == 503 and "stopping" in str(results["queued"])
        assert isinstance(results["long"], openai.APIError) and "stopping" in str(results["long"])
        assert proc.wait(timeout=30) == 130                  # as any command stopped by Ctrl-C
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
