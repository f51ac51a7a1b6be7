"""`tinyrt serve`: the OpenAI-compatible server, run for real (uvicorn on a free localhost port)
and spoken to with the official `openai` client: chat, completions and the Responses API, whole and
streamed, models, auth, errors, the queue, cancelling mid-stream, and reusing the KV cache across
turns; ollama's API spoken to with the official `ollama` client; any model's name; the log."""

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

import ollama
import openai
import pytest
import uvicorn

import tinyrt
from helpers import tiny_config, write_tiny_model
from tinyrt.cli.serve import MAX_BODY, model_names
from tinyrt.server import Server

KEY = "sesame"
HANG = 60          # seconds: a hang detector, not a speed check (a shared machine may stall)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "m", tiny_config(), seed=7)


class Running:
    """A Server on uvicorn in a thread, on a port the OS picked; its log lines in `lines`."""

    def __init__(self, llm, *, api_key=None, max_queue=8, max_body=MAX_BODY, name="tiny",
                 **options):
        self.llm, self.lines = llm, []
        self.server = Server(llm, name, api_key=api_key, max_queue=max_queue, max_body=max_body,
                             log=self.lines.append, **options)
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
        self.client = openai.OpenAI(base_url=self.url + "/v1",
                                    api_key=api_key if api_key and api_key.isascii() else "none",
                                    max_retries=0, timeout=60)
        self.ollama = ollama.Client(host=self.url, timeout=60)

    def health(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url + "/health", timeout=10).read())

    def idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (h := self.health())["running"] or h["waiting"]:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.01)

    def alone(self, ask):
        """`ask()` on an empty cache (as a fresh LLM has it): replies compared token for token
        come from the same cache state."""
        self.idle()
        self.llm.reset()
        return ask()

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
        with pytest.raises(openai.AuthenticationError):
            bad.responses.create(model="tiny", input="hi")
        # ollama's API too: a key the ollama client sends as a header
        keyed = ollama.Client(host=run.url, headers={"Authorization": f"Bearer {KEY}"})
        assert [m.model for m in keyed.list().models] == ["tiny"]
        for call in (run.ollama.list, lambda: run.ollama.chat(model="tiny", messages=[
                {"role": "user", "content": "hi"}]), lambda: run.ollama.show("tiny")):
            with pytest.raises(ollama.ResponseError) as e:
                call()
            assert e.value.status_code == 401 and "API key" in e.value.error
        assert run.health()["status"] == "ok"        # (monitoring needs no key)
    finally:
        run.stop()


def test_undecodable_names_and_keys_never_fail_a_reply(tmp_path):
    """A model folder's name, an --alias or an --api-key of bytes that are not UTF-8 (as the
    command line gives them: surrogate-escaped), a chat template with a lone surrogate: every
    endpoint still answers, in valid JSON (U+FFFD where a name cannot be text), the key is
    checked byte for byte."""
    import http.client
    import shutil

    folder = tmp_path / os.fsdecode(b"m\xff\xfe")
    shutil.copytree(write_tiny_model(tmp_path / "src", tiny_config(), seed=7), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "\udc80" + config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    key = os.fsdecode(b"k\xe9y\xff")
    run = Running(tinyrt.LLM(folder, device="reference", kv_size=128), api_key=key,
                  name=folder.name,
                  aliases=[os.fsdecode(b"alias\xff")])
    try:
        assert run.health()["model"] == "m\ufffd\ufffd"

        def ask(method, path, key_bytes, body=None):
            c = http.client.HTTPConnection("127.0.0.1", run.port, timeout=30)
            c.putrequest(method, path)
            c.putheader("Authorization", b"Bearer " + key_bytes)
            c.putheader("Content-Type", "application/json")
            data = json.dumps(body).encode() if body is not None else b""
            c.putheader("Content-Length", str(len(data)))
            c.endheaders(data)
            r = c.getresponse()
            return r.status, r.read()

        good = os.fsencode(key)
        for bad in (b"key", good + b"x", "k\u00e9y\u00ff".encode()):
            assert ask("GET", "/v1/models", bad)[0] == 401
        status, data = ask("GET", "/v1/models", good)
        assert status == 200 and json.loads(data)["data"][0]["id"] == "m\ufffd\ufffd"
        for path in ("/api/tags", "/api/ps"):
            status, data = ask("GET", path, good)
            assert status == 200 and json.loads(data)["models"][0]["name"] == "m\ufffd\ufffd"
        status, data = ask("POST", "/api/show", good, {"model": "x"})
        assert status == 200 and json.loads(data)["template"].startswith("\ufffd")
        for path in ("/v1/chat/completions", "/api/chat"):
            for stream in (False, True):
                status, data = ask("POST", path, good, {"messages": HI, "max_tokens": 3,
                                                        "stream": stream})
                assert status == 200, data
                lines = [x.removeprefix(b"data: ") for x in data.splitlines() if x.strip()]
                assert all(x == b"[DONE]" or json.loads(x) for x in lines)
    finally:
        run.stop()


@pytest.mark.parametrize("metadata", ["{\"a\": 1e999}", "{\"a\": \"\\ud800\"}",
                                      "{\"a\": 1}", "[\"a\"]", "{\"a\": \"b\", \"c\": {}}",
                                      json.dumps({str(i): "v" for i in range(17)}),
                                      json.dumps({"a": "v" * 513}), json.dumps({"k" * 65: "v"})])
@pytest.mark.parametrize("stream", [False, True])
def test_echoed_fields_are_checked_as_read_ones(served, metadata, stream):
    """The Responses API echoes `metadata`: a number a double cannot hold, a lone surrogate, a
    value that is not a string, or more than OpenAI takes is a 400 naming what is wrong, never
    a 500 nor a reply that is not JSON (streamed: Infinity in an event)."""
    body = (f'{{"input": "hi", "max_output_tokens": 2, "stream": {json.dumps(stream)}, '
            f'"metadata": {metadata}}}').encode()
    status, reply = post(served.url + "/v1/responses", body)
    assert status == 400, reply
    assert any(w in reply["error"]["message"] for w in ("metadata", "range", "surrogate"))


def test_echoed_metadata_comes_back_as_sent(served):
    meta = {"run": "7", "note": "é \u2603"}
    r = served.client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                       metadata=meta)
    assert r.metadata == meta


def test_a_conversation_longer_than_the_cache_leaves_its_oldest_turns_out(served):
    """As ollama truncates a chat to its context: the system message and the newest turns go
    to the model, the reply has room (a conversation of 40 turns, a cache of 256)."""
    history = [{"role": "system", "content": "S"}]
    for i in range(20):
        history += [{"role": "user", "content": f"question {i} " * 3},
                    {"role": "assistant", "content": f"answer {i} " * 3}]
    history.append({"role": "user", "content": "last"})
    r = served.client.chat.completions.create(model="tiny", messages=history, max_tokens=8,
                                              temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens <= 256 - 8
    newest = chat_ids(served.llm, [history[0], *history[-3:]])
    assert r.usage.prompt_tokens >= len(newest)
    reply = served.ollama.chat(model="tiny", messages=history, options={"num_predict": 8})
    assert reply.message.content and reply.prompt_eval_count <= 256 - 8


# -- any model's name ------------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]


def test_any_model_name_is_the_served_model(served):
    """As llama-server serving one model: whatever model a client names (an alias, another
    vendor's, none), the one model answers, and the reply names it. A lookup of one model by
    name still says whether the server has it."""
    for model in ("default", "gpt-4o-mini", "smollm2", ""):
        r = served.client.chat.completions.create(model=model, messages=HI, max_tokens=2)
        assert r.model == "tiny" and r.usage.completion_tokens >= 1
    r = served.client.completions.create(model="gpt-3.5-turbo-instruct", prompt="x", max_tokens=2)
    assert r.model == "tiny"
    status, body = post(served.url + "/v1/chat/completions",
                        json.dumps({"messages": HI, "max_tokens": 2}).encode())
    assert status == 200 and body["model"] == "tiny"
    assert served.ollama.chat(model="llama3.2", messages=HI, options={"num_predict": 2}).model \
        == "tiny"
    assert [m.id for m in served.client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("gpt-4o")


def test_strict_model_refuses_other_names(tiny):
    """strict_model (`tinyrt serve --strict-model`): the served model's name, its aliases (with
    ollama's ':latest' or without) and nothing else."""
    run = Running(tinyrt.LLM(tiny, device="reference", kv_size=128), strict_model=True,
                  aliases=("tiny", "smol"))
    try:
        for model in ("tiny", "smol", "smol:latest"):
            r = run.client.chat.completions.create(model=model, messages=HI, max_tokens=2)
            assert r.model == "tiny"
        assert run.client.models.retrieve("smol").id == "tiny"
        for ask in (lambda m: run.client.chat.completions.create(model=m, messages=HI),
                    lambda m: run.client.completions.create(model=m, prompt="x"),
                    lambda m: run.client.responses.create(model=m, input="x")):
            with pytest.raises(openai.NotFoundError) as e:
                ask("gpt-4o")
            assert e.value.body["code"] == "model_not_found" and "tiny" in e.value.body["message"]
        for ask in (lambda m: run.ollama.chat(model=m, messages=HI), run.ollama.show,
                    lambda m: run.ollama.generate(model=m, prompt="x")):
            with pytest.raises(ollama.ResponseError) as e:
                ask("llama3.2")
            assert e.value.status_code == 404 and "'llama3.2' does not exist" in e.value.error
    finally:
        run.stop()


def test_model_names_of_a_known_model():
    """The names `tinyrt serve` answers to: MODEL as given, and a known model's name and
    aliases whichever of them is given."""
    from tinyrt.model_cache import DEFAULT_MODEL

    default = model_names(None)
    assert default[0] == DEFAULT_MODEL and {"default", "smollm2"} <= set(default)
    assert model_names("smollm2")[0] == "smollm2" and set(model_names("smollm2")) == set(default)
    assert model_names("models/mine.gguf") == ["models/mine.gguf"]


# -- the Responses API -----------------------------------------------------------------------------

QUESTION = "What is the capital of France?"
SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_responses_is_the_chat_reply_whole(served):
    """/v1/responses with the openai client's responses.create: `instructions` and `input` (a
    string, or messages with input_text parts) are the chat endpoint's system and user
    messages, max_output_tokens its max_tokens; the reply, its usage and its status."""
    chat = served.alone(lambda: served.client.chat.completions.create(
        model="tiny", messages=SYSTEM, max_tokens=12, **GREEDY))
    want = chat.choices[0].message.content
    assert want
    r = served.alone(lambda: served.client.responses.create(
        model="gpt-4.1", instructions="Be brief.", input=QUESTION, max_output_tokens=12, **GREEDY))
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == want and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    parts = [{"type": "input_text", "text": "What is the capital"},
             {"type": "input_text", "text": " of France?"}]
    listed = served.alone(lambda: served.client.responses.create(
        model="tiny", input=[{"role": "developer", "content": "Be brief."},
                             {"role": "user", "content": parts}], max_output_tokens=12, **GREEDY))
    assert listed.output_text == want
    # a reply cut by a stop string is complete
    stop = want[3:5]
    cut = served.alone(lambda: served.client.responses.create(
        model="tiny", instructions="Be brief.", input=QUESTION, max_output_tokens=12,
        temperature=0, extra_body={"ignore_eos": True, "stop": [stop]}))
    assert cut.status == "completed" and cut.output_text == want[:want.index(stop)]


def test_responses_streamed_events(served):
    """stream=True: the Responses API's events as the openai client parses them, in order and
    numbered; their text is the whole reply's; the client's stream helper assembles it."""
    whole = served.alone(lambda: served.client.responses.create(
        model="tiny", instructions="Be brief.", input=QUESTION, max_output_tokens=12, **GREEDY))
    stop = whole.output_text[3:5]
    want = whole.output_text[:whole.output_text.index(stop)]
    kw = dict(model="tiny", instructions="Be brief.", input=QUESTION, max_output_tokens=12,
              temperature=0, extra_body={"ignore_eos": True, "stop": [stop]})
    events = served.alone(lambda: list(served.client.responses.create(**kw, stream=True)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events[4:-4]) == want and events[-4].text == want
    assert events[0].response.status == "in_progress" and events[0].response.model == "tiny"
    done = events[-1].response
    assert done.status == "completed" and done.output_text == want
    assert done.usage.input_tokens == whole.usage.input_tokens
    assert done.id == events[0].response.id and len({e.item_id for e in events[3:-2]}) == 1
    with served.alone(lambda: served.client.responses.stream(**kw)) as stream:
        assert stream.get_final_response().output_text == want
    # cut by max_output_tokens: response.incomplete
    events = served.alone(lambda: list(served.client.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=3, stream=True, **GREEDY)))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage.output_tokens == 3


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "name": "f", "parameters": {}}]),
    ("previous_response_id", "resp_1"), ("text", {"format": {"type": "json_object"}}),
    ("text", {"format": "json"}), ("background", True), ("reasoning", {"effort": "high"}),
    ("truncation", "auto"), ("tool_choice", "required"), ("n", 2),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ("input", [{"type": "function_call_output", "call_id": "c", "output": "x"}]),
    ("input", []), ("input", 5), ("input", [{"role": "wizard", "content": "x"}]),
    ("input", "\ud800"), ("instructions", 3), ("max_output_tokens", 0), ("temperature", -1),
    ("top_p", 0), ("stream", "yes"),
])
def test_responses_bad_fields_get_400_naming_the_field(served, field, value):
    body = {"model": "tiny", "input": "hi", field: value}
    status, err = post(served.url + "/v1/responses", json.dumps(body).encode())
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error" and field in err["error"]["param"]


# -- ollama's API ----------------------------------------------------------------------------------

def test_ollama_lists_and_shows_the_model(served):
    models = served.ollama.list().models
    assert [m.model for m in models] == ["tiny"] and models[0].size > 0
    assert models[0].details.family == "llama" and models[0].details.format == "safetensors"
    shown = served.ollama.show("any name")
    assert shown.details.family == "llama" and shown.capabilities == ["completion"]
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 512          # (tiny_config's)
    assert shown.template == served.llm.template.source
    assert "num_ctx 256" in shown.parameters                       # (the served cache's)
    version = json.loads(urllib.request.urlopen(served.url + "/api/version", timeout=10).read())
    assert version == {"version": tinyrt.__version__}


def test_ollama_chat_is_the_chat_reply_whole_and_streamed(served):
    """/api/chat with the ollama client: the chat endpoint's reply for the same messages and
    settings, whole and streamed, with ollama's counts."""
    want = served.alone(lambda: served.client.chat.completions.create(
        model="tiny", messages=SYSTEM, max_tokens=12, **GREEDY))
    text = want.choices[0].message.content
    options = {"temperature": 0, "num_predict": 12, "ignore_eos": True}
    r = served.alone(lambda: served.ollama.chat(model="tiny", messages=SYSTEM, options=options))
    assert r.message.role == "assistant" and r.message.content == text and text
    assert r.model == "tiny" and r.done and r.done_reason == "length"
    assert r.prompt_eval_count == want.usage.prompt_tokens and r.eval_count == 12
    assert r.total_duration > 0 and r.load_duration == 0 and r.eval_duration > 0
    parts = served.alone(lambda: list(served.ollama.chat(model="tiny", messages=SYSTEM,
                                                         options=options, stream=True)))
    assert "".join(p.message.content for p in parts) == text
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 12
    assert parts[-1].prompt_eval_count == want.usage.prompt_tokens
    # no messages: ollama's request that only loads the model
    loaded = served.ollama.chat(model="tiny", messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""


def test_ollama_generate_templated_raw_and_streamed(served):
    """/api/generate: the prompt (and system) through the chat template as a conversation, or
    with raw as it is (the completions endpoint's prompt); ollama streams unless told not to."""
    chat = served.alone(lambda: served.client.chat.completions.create(
        model="tiny", messages=SYSTEM, max_tokens=10, **GREEDY)).choices[0].message.content
    plain = served.alone(lambda: served.client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=10, **GREEDY)).choices[0].text
    assert chat != plain
    options = {"temperature": 0, "num_predict": 10, "ignore_eos": True}
    r = served.alone(lambda: served.ollama.generate(model="tiny", prompt=QUESTION,
                                                    system="Be brief.", options=options))
    assert r.response == chat and r.done_reason == "length" and r.eval_count == 10
    raw = served.alone(lambda: served.ollama.generate(model="tiny", prompt="def f(x):", raw=True,
                                                      options=options))
    assert raw.response == plain
    parts = served.alone(lambda: list(served.ollama.generate(
        model="tiny", prompt="def f(x):", raw=True, options=options, stream=True)))
    assert "".join(p.response for p in parts) == plain and parts[-1].done
    # without "stream": NDJSON lines (ollama's default)
    body = json.dumps({"model": "tiny", "prompt": "def f(x):", "raw": True, "options": options})
    req = urllib.request.Request(served.url + "/api/generate", data=body.encode())
    with urllib.request.urlopen(req, timeout=30) as got:
        assert got.headers["Content-Type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in got.read().splitlines()]
    assert len(lines) > 2 and [x["done"] for x in lines[-2:]] == [False, True]
    assert "".join(x["response"] for x in lines) == plain
    assert served.ollama.generate(model="tiny", prompt="").done_reason == "load"


@pytest.mark.parametrize("name,value,openai_field", [
    ("temperature", 0, "temperature"), ("top_k", 1, "top_k"), ("top_p", 0.05, "top_p"),
    ("min_p", 0.9, "min_p"), ("seed", 4, "seed"), ("repeat_penalty", 3.0, "repeat_penalty"),
    ("presence_penalty", 2.0, "presence_penalty"), ("frequency_penalty", 2.0, "frequency_penalty"),
    ("num_predict", 3, "max_tokens"),
])
def test_ollama_options_act_as_the_openai_fields(served, name, value, openai_field):
    """Each of ollama's options is the OpenAI (or llama.cpp) field of the same meaning: the
    sampled reply with it set is /v1/completions's with that field, and not the reply without
    it (so the option is not ignored)."""
    base = dict(seed=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)

    def theirs(**options):
        return served.ollama.generate(model="tiny", prompt="The", raw=True, options={
            **base, "num_predict": 8, "ignore_eos": True, **options}).response

    def ours(**fields):
        return served.client.completions.create(model="tiny", prompt="The", extra_body={
            **base, "max_tokens": 8, "ignore_eos": True, **fields}).choices[0].text

    plain = theirs()
    assert plain == ours()
    assert theirs(**{name: value}) == ours(**{openai_field: value}) != plain


def test_ollama_stop_and_runtime_options(served):
    """stop cuts the reply; options that set up ollama's runtime (num_ctx, num_thread, ...) are
    taken and change nothing; num_predict's values below 0."""
    options = {"temperature": 0, "num_predict": 12, "ignore_eos": True}
    whole = served.ollama.generate(model="tiny", prompt="def f(x):", raw=True,
                                   options=options).response
    stop = whole[3:5]
    cut = served.ollama.generate(model="tiny", prompt="def f(x):", raw=True,
                                 options={**options, "stop": [stop]})
    assert cut.response == whole[:whole.index(stop)] and cut.done_reason == "stop"
    runtime = {**options, "num_ctx": 8192, "num_thread": 4, "num_gpu": 99, "mirostat": 0}
    assert served.ollama.generate(model="tiny", prompt="def f(x):", raw=True,
                                  options=runtime).response == whole
    # num_predict -1 (ollama's "no limit") and -2 ("fill the context"): the cache's end, as
    # /v1/completions without max_tokens
    unbounded = served.client.completions.create(model="tiny", prompt="def f(x):", **GREEDY)
    for n in (-1, -2):
        r = served.ollama.generate(model="tiny", prompt="def f(x):", raw=True,
                                   options={**options, "num_predict": n})
        assert r.eval_count == unbounded.usage.completion_tokens and r.done_reason == "length"


@pytest.mark.parametrize("path,body,words", [
    ("/api/chat", {"messages": HI, "options": {"temperature": -1}}, "temperature must be"),
    ("/api/chat", {"messages": HI, "options": {"temprature": 0.5}}, "did you mean 'temperature'"),
    ("/api/chat", {"messages": HI, "options": {"mirostat": 2}}, "mirostat"),
    ("/api/chat", {"messages": HI, "options": {"num_predict": 0}}, "num_predict must be"),
    ("/api/chat", {"messages": HI, "options": [1]}, "options"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
    ("/api/chat", {"messages": HI, "tools": [{"type": "function"}]}, "tools"),
    ("/api/chat", {"messages": "hi"}, "messages"),
    ("/api/chat", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/api/generate", {"prompt": "hi", "format": "json"}, "format"),
    ("/api/generate", {"prompt": "hi", "think": True}, "think"),
    ("/api/generate", {"prompt": "hi", "raw": True, "system": "x"}, "system"),
    ("/api/generate", {"prompt": 5}, "prompt"),
    ("/api/generate", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/api/generate", {"prompt": "def f(x): " * 200}, "context holds 256"),
    ("/api/show", "{not json", "not valid JSON"),
])
def test_ollama_errors_have_ollama_s_shape(served, path, body, words):
    data = body.encode() if isinstance(body, str) else json.dumps(
        {"model": "tiny", "stream": False, **body}).encode()
    status, err = post(served.url + path, data)
    assert status == 400 and set(err) == {"error"} and words in err["error"], err
    with pytest.raises(ollama.ResponseError) as e:        # as the ollama client reports it
        served.ollama.chat(model="tiny", messages=HI, options={"top_k": -1})
    assert e.value.status_code == 400 and "top_k must be" in e.value.error


def test_ollama_unknown_endpoints_and_methods(served):
    status, err = post(served.url + "/api/push", b"{}")
    assert status == 404 and set(err) == {"error"} and "/api/push" in err["error"]
    status, err = post(served.url + "/api/tags", b"{}")
    assert status == 405 and set(err) == {"error"}


# -- the log ---------------------------------------------------------------------------------------

def logged(run, *patterns, since: int) -> list[str]:
    """The log lines after the first `since`, once one matches each pattern (regular
    expressions, whole lines; the line is written once the reply has gone)."""
    deadline = time.monotonic() + HANG
    while True:
        lines = run.lines[since:]
        if all(any(re.fullmatch(p, line) for line in lines) for p in patterns):
            return lines
        assert time.monotonic() < deadline, (patterns, lines)
        time.sleep(0.01)


def test_each_request_is_logged_in_one_line(served):
    """Method, path, status, the prompt's and the reply's tokens where it generated (the
    usage the client got), and the time, whole and streamed, for every API and every status."""
    served.idle()
    since = len(served.lines)
    r = served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=5,
                                              **GREEDY)
    u = r.usage
    chunks = list(served.client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=7, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    s = chunks[-1].usage
    g = served.ollama.generate(model="tiny", prompt="x", options={"num_predict": 4})
    served.client.models.list()
    post(served.url + "/v1/embeddings", b"{}")
    post(served.url + "/v1/chat/completions", b"{}")
    post(served.url + "/v1/a%0Ab", b"")                 # (a newline, decoded in the path)
    lines = logged(served,
                   rf"POST /v1/chat/completions 200 {u.prompt_tokens}\+5 tokens \d+ ms",
                   rf"POST /v1/completions 200 {s.prompt_tokens}\+7 tokens \d+ ms",
                   rf"POST /api/generate 200 {g.prompt_eval_count}\+{g.eval_count} tokens \d+ ms",
                   r"GET /v1/models 200 \d+ ms", r"POST /v1/embeddings 404 \d+ ms",
                   r"POST /v1/chat/completions 400 \d+ ms", r"POST /v1/a\\nb 404 \d+ ms",
                   since=since)
    assert all("\n" not in line for line in lines)
    assert len([x for x in lines if not x.startswith("GET /health ")]) == 7


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

def _served_at(proc) -> str:
    """The base URL a `tinyrt serve` process says it serves at (within 120 s)."""
    line = ""
    deadline = time.monotonic() + 120
    while "serving" not in line:
        assert time.monotonic() < deadline and proc.poll() is None, line
        line = proc.stderr.readline()
    return re.search(r"(http://\S+)/v1", line).group(1)


def test_tinyrt_serve_logs_each_request_once_and_takes_strict_model(tiny):
    """`tinyrt serve`: one line on stderr for each request (uvicorn's access log does not say it
    again); --strict-model refuses another model's name and takes MODEL as given and --alias."""
    proc = subprocess.Popen([sys.executable, "-m", "tinyrt", "serve", str(tiny), "--port", "0",
                             "--device", "reference", "--kv-size", "64", "--alias", "tiny",
                             "--strict-model"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TINYRT_API_KEY": ""})
    try:
        url = _served_at(proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=str(tiny), messages=HI, max_tokens=3,
                                           **GREEDY)
        assert r.model == "tiny"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4o", messages=HI)
        assert [m.model for m in ollama.Client(host=url, timeout=60).list().models] == ["tiny"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=HANG) == 130
        rest, out = proc.stderr.read().splitlines(), proc.stdout.read().splitlines()
    finally:
        proc.kill()
        proc.wait()
    requests = sorted(x for x in rest if re.match(r"(GET|POST) ", x))
    want = [r"GET /api/tags 200 \d+ ms", r"POST /v1/chat/completions 200 "
            rf"{r.usage.prompt_tokens}\+3 tokens \d+ ms", r"POST /v1/chat/completions 404 \d+ ms"]
    assert len(requests) == 3 and all(map(re.fullmatch, want, requests)), requests
    assert not any("HTTP/1.1" in x for x in rest + out), rest + out  # (uvicorn's access log)

@pytest.mark.real_model
def test_tinyrt_serve_with_the_default_model(smol):
    """`tinyrt serve` on the default model: the greedy answer through the server is the API's,
    a follow-up turn prefills only its new tokens, and Ctrl-C stops it cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "tinyrt", "serve", str(smol), "--port", "0",
                             "--alias", "smol"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TINYRT_API_KEY": ""})
    try:
        url = _served_at(proc) + "/v1"
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


def test_ollama_s_probes_and_one_model_endpoints(served):
    """What ollama's clients probe and ask of a server of one model: GET / (200), /api/ps (the
    loaded model), /api/tags' parameter size and quantization, /api/pull of the served model
    (success at once; another model is refused), /api/embed (each input a unit vector of the
    hidden size: the mean of its final hidden states, as LLM.embed)."""
    import numpy as np

    r = urllib.request.urlopen(served.url + "/", timeout=10)
    assert r.status == 200 and b"running" in r.read()
    running = served.ollama.ps().models
    assert [m.model for m in running] == ["tiny"] and running[0].size > 0
    details = served.ollama.list().models[0].details
    assert details.parameter_size.endswith("M") and details.quantization_level == "F32"
    assert served.ollama.pull("tiny").status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        served.ollama.pull("llama3")
    assert e.value.status_code == 404
    got = served.ollama.embed(model="tiny", input=["hello there", "a second text"])
    vectors = np.array(got.embeddings)
    assert vectors.shape == (2, 96) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    served.idle()
    want = served.llm.embed("hello there")
    assert np.allclose(vectors[0], want, atol=1e-6) and got.prompt_eval_count > 2
    status, err = post(served.url + "/api/embed", b'{"input": []}')
    assert status == 400 and "input" in err["error"]


def test_an_api_key_no_header_can_carry_is_refused_at_start(tiny):
    """A key with a control character (an escape, a newline) could never be matched: HTTP
    servers refuse such a header before the app sees it. One line, before the model loads."""
    from helpers import assert_refused, run_tinyrt

    for key in ("se\x1bsame", "two\nlines"):
        assert_refused(run_tinyrt("serve", str(tiny), "--api-key", key, "--port", "0"),
                       "control character", "--api-key")
        assert_refused(run_tinyrt("serve", str(tiny), "--port", "0",
                                  env={"TINYRT_API_KEY": key}), "control character")
