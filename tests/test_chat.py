"""ChatSession and `tinyrt chat`: multi-turn reuse of the KV cache, stopping a reply, the cache
policies, saving, and the real command driven in a pseudo-terminal and through a pipe."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import tinyrt
from helpers import HOSTILE_BYTES, run_tinyrt, tiny_config, write_tiny_model
from tinyrt import chat as chat_module
from tinyrt.errors import CacheFullError, TinyrtError

rng = np.random.default_rng()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("chat") / "m", tiny_config(), seed=5)


class Fed:
    """Records what the model's cache holds: every completed forward pass (start position,
    tokens), replayed into the token sequence the cache holds."""

    def __init__(self, llm):
        self.calls, self.llm = [], llm
        forward = llm.model.forward

        def logged(tokens, cache, **kw):
            start = cache.next_pos
            out = forward(tokens, cache, **kw)
            self.calls.append((start, [int(t) for t in tokens]))
            return out

        llm.model.forward = logged

    def sequence(self, calls: int | None = None) -> list[int]:
        seq = []
        for start, tokens in self.calls[:calls]:
            seq = seq[:start] + tokens
        return seq


def turn(chat, fed, text, **options):
    """One turn; returns (reply, the tokens its prefill fed), and checks that after the prefill
    the cache held exactly the rendered conversation up to the new assistant turn."""
    before = len(fed.calls)
    reply = "".join(r.text for r in chat.send(text, **options))
    prompt_text = chat.template.render(chat.history[:-1], add_generation_prompt=True)
    held = fed.sequence(before + 1)
    assert chat.llm.tokenizer.decode(held, skip_special=False) == prompt_text
    return reply, fed.calls[before][1]


@pytest.mark.parametrize("policy", ["dense", "sink"])
def test_each_turn_prefills_only_itself(tiny, policy):
    llm = tinyrt.LLM(tiny, device="reference", kv_size=512, kv_policy=policy)
    fed = Fed(llm)
    chat = tinyrt.ChatSession(llm, system="Be brief.", max_tokens=24, temperature=0)
    _, first = turn(chat, fed, "hello there")
    full = len(first)
    for i in range(4):
        reply, prompt = turn(chat, fed, f"and turn {i}")
        whole = len(llm.tokenizer.encode(chat.template.render(chat.history[:-1])))
        assert len(prompt) == chat.last.prompt_tokens and len(prompt) < whole - full
    assert [m["role"] for m in chat.history] == ["system"] + ["user", "assistant"] * 5
    assert chat.history[-1]["content"] == reply


def test_stopped_replies_stay_and_the_cache_stays_right(tiny):
    """Leaving the loop after a few tokens, and Ctrl-C in the middle of a forward pass (a
    KeyboardInterrupt from inside the model): the reply so far stays in the history, the
    half-done pass is rolled back, and the next turn still prefills only itself."""
    llm = tinyrt.LLM(tiny, device="reference", kv_size=512)
    fed = Fed(llm)
    chat = tinyrt.ChatSession(llm, max_tokens=40, temperature=0, ignore_eos=True)
    turn(chat, fed, "first")
    replies = chat.send("second")
    seen = [r.text for _, r in zip(range(5), replies)]
    replies.close()
    assert chat.history[-1]["content"].startswith("".join(seen)) and chat.last_finish is None
    _, prompt = turn(chat, fed, "third")
    assert len(prompt) < 40

    rmsnorm, calls = llm.backend.rmsnorm, [0]

    def interrupted(*a):                         # the 4th norm of the 8th decode step
        calls[0] += 1
        if calls[0] == 2 * 3 + 7 * 5 + 4:
            raise KeyboardInterrupt
        return rmsnorm(*a)

    llm.backend.rmsnorm = interrupted
    with pytest.raises(KeyboardInterrupt):
        for _ in chat.send("fourth"):
            pass
    llm.backend.rmsnorm = rmsnorm
    assert chat.history[-2]["content"] == "fourth" and len(chat.messages) == 8
    assert llm.cache.next_pos == len(fed.sequence())          # the cut pass rolled back
    _, prompt = turn(chat, fed, "fifth")
    assert len(prompt) < 40


def test_a_cache_that_cannot_roll_back_prefills_everything_again(tiny):
    llm = tinyrt.LLM(tiny, device="reference", kv_size=64, kv_policy="sink")
    fed = Fed(llm)
    chat = tinyrt.ChatSession(llm, max_tokens=80, temperature=0, ignore_eos=True)
    turn(chat, fed, "first")                     # evicts: 80 tokens through 64 slots
    rmsnorm = llm.backend.rmsnorm
    llm.backend.rmsnorm = lambda *a: (_ for _ in ()).throw(KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        list(chat.send("second"))
    llm.backend.rmsnorm = rmsnorm
    before = len(fed.calls)
    turn(chat, fed, "third")                     # (which checks that it is the whole text)
    assert fed.calls[before][0] == 0 and chat.last.cached_tokens == 0


def test_complete_keeps_the_longest_common_prefix_of_what_the_cache_holds(tiny):
    llm = tinyrt.LLM(tiny, device="reference", kv_size=256)
    fed = Fed(llm)
    encode = llm.tokenizer.encode
    a, b = encode("def f(x):\n    return x * 2"), encode("def f(y): café")
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > 0

    def reply(ids, **kw):
        gen = llm.complete(ids, max_tokens=6, temperature=0, ignore_eos=True, **kw)
        list(gen)
        return gen

    first = reply(a)
    assert first.timings.cached_tokens == 0
    assert fed.sequence() == a + list(first.tokens[:-1])      # the last token was not run
    second = reply(b)
    assert second.timings.cached_tokens == common and second.timings.prompt_tokens == len(b) - common
    assert fed.sequence() == b + list(second.tokens[:-1])
    extended = b + list(second.tokens) + encode(" more")      # a conversation's next turn
    third = reply(extended)
    assert third.timings.cached_tokens == len(b) + len(second.tokens) - 1
    again = reply(extended)                                   # the same prompt: its last token runs
    assert again.timings.cached_tokens == len(extended) - 1
    assert list(again.tokens) == list(third.tokens)
    llm.generation(encode("x"), max_tokens=2)                  # (not `complete`: the cache is unknown)
    assert reply(extended).timings.cached_tokens == 0
    reply(extended)
    llm.cache.reset()                                          # (used outside `complete`)
    assert reply(extended).timings.cached_tokens == 0


def test_complete_starts_empty_where_the_cache_evicted_what_it_would_keep(tiny):
    for policy, kv_type in (("sink", "f16"), ("h2o", "f16"), ("h2o", "q8")):
        llm = tinyrt.LLM(tiny, device="reference", kv_size=64, kv_policy=policy, kv_type=kv_type)
        fed = Fed(llm)
        ids = llm.tokenizer.encode("def f(x):")
        gen = llm.complete(ids, max_tokens=100, temperature=0, ignore_eos=True)   # evicts
        list(gen)
        longer = ids + list(gen.tokens)
        nxt = llm.complete(longer + [5], max_tokens=2, temperature=0)   # appends: nothing to undo
        list(nxt)
        assert nxt.timings.cached_tokens == len(longer) - 1
        other = llm.complete(ids + [7], max_tokens=2, temperature=0)
        list(other)
        assert other.timings.cached_tokens == 0 and fed.calls[-2][0] == 0
    # h2o over codes has a spare block of slots past its size: evicting, it still holds fewer
    # tokens than it has slots, and must refuse to take back the last of them all the same
    llm = tinyrt.LLM(tiny, device="reference", kv_size=48, kv_policy="h2o", kv_type="q8")
    a = list(map(int, rng.integers(3, 300, 40)))
    list(llm.complete(a, max_tokens=30, temperature=0, ignore_eos=True))
    assert llm.cache.next_pos - 30 < llm.cache.length < llm.cache.capacity
    assert llm.complete(a[:30] + [7], max_tokens=2).timings.cached_tokens == 0


def test_a_request_that_takes_back_the_sinks_gets_its_own(tiny):
    """A sink cache with a draft's slack rolls back past its size; a prompt sharing fewer than
    the sinks with the last one gives the sinks new tokens, whose keys (not the old ones') the
    window's next move re-rotates: the reply is a fresh cache's."""
    kw = dict(device="reference", kv_type="f32", kv_size=48, kv_policy="sink", draft="layers:1")
    llm, fresh = tinyrt.LLM(tiny, **kw), tinyrt.LLM(tiny, **kw)
    a, b = (list(map(int, rng.integers(3, 300, 40))) for _ in range(2))
    list(llm.complete(a, max_tokens=12, temperature=0, ignore_eos=True))
    assert llm.cache.next_pos > llm.cache.size and llm.cache.sink_keys is not None
    opts = dict(max_tokens=20, temperature=0, ignore_eos=True)
    got = llm.complete(b, **opts)
    assert [r.token for r in got] == [r.token for r in fresh.complete(b, **opts)]
    assert got.timings.cached_tokens < llm.cache.n_sink


def test_dense_overflow_is_a_clear_error_and_sink_goes_on(tiny):
    llm = tinyrt.LLM(tiny, kv_size=96)
    chat = tinyrt.ChatSession(llm, max_tokens=30, temperature=0, ignore_eos=True)
    with pytest.raises(CacheFullError, match="room for"):
        for i in range(10):
            list(chat.send(f"message number {i}"))
    assert 1 <= len(chat.messages) // 2 < 10
    chat.reset()
    assert chat.history == [] and "".join(r.text for r in chat.send("again")) is not None
    sink = tinyrt.ChatSession(tinyrt.LLM(tiny, kv_size=96, kv_policy="sink"), max_tokens=30,
                              temperature=0, ignore_eos=True)
    for i in range(10):
        list(sink.send(f"message number {i}"))
    assert len(sink.messages) == 20 and sink.llm.cache.next_pos > 300


def test_save_and_load(tiny, tmp_path):
    llm = tinyrt.LLM(tiny, kv_size=256)
    chat = tinyrt.ChatSession(llm, system="S", max_tokens=8, temperature=0)
    list(chat.send("one"))
    chat.settings["temperature"] = 0.5
    path = chat.save(tmp_path / "odd name é.json")
    other = tinyrt.ChatSession(llm, max_tokens=3)
    other.load(path)
    assert other.history == chat.history and other.settings["temperature"] == 0.5
    list(other.send("two"))                      # the loaded conversation prefilled whole
    assert other.last.prompt_tokens == len(llm.tokenizer.encode(
        other.template.render(other.history[:-1])))
    bad = {"not json": "{", "not ours": json.dumps({"messages": []}),
           "bad message": json.dumps({"format": "tinyrt-chat", "messages": [{"role": "x"}]}),
           "bad setting": json.dumps({"format": "tinyrt-chat", "messages": [],
                                      "settings": {"__class__": 1}})}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(TinyrtError):
            other.load(tmp_path / name)
    with pytest.raises(TinyrtError, match="cannot read"):
        other.load(tmp_path / "missing.json")
    with pytest.raises(TinyrtError, match="cannot save"):
        chat.save(tmp_path / "no such dir" / "c.json")
    assert other.history[-2]["content"] == "two"            # a failed load changes nothing


@pytest.mark.parametrize("name", ["", "  ", "a\0b", "~no_such_user_here/c.json", "/", "DIR",
                                  "x" * 300, "/dev/zero", "FIFO", "BIG"])
def test_save_and_load_odd_paths(tiny, tmp_path, name):
    """Odd names for /save and /load: a clear error, nothing read without end, nothing but a
    regular file replaced, nothing left."""
    chat = tinyrt.ChatSession(tinyrt.LLM(tiny, kv_size=256), max_tokens=4, temperature=0)
    list(chat.send("one"))
    history = chat.history
    if name == "DIR":
        name = str(tmp_path)
    elif name == "FIFO":                         # reading it would wait for a writer forever
        name = str(tmp_path / "fifo")
        os.mkfifo(name)
    elif name == "BIG":                          # sparse: large, nothing on disk
        name = str(tmp_path / "big.json")
        with open(name, "wb") as f:
            f.truncate(chat_module.MAX_SAVED_BYTES + 1)
    with pytest.raises(TinyrtError) as e:
        chat.load(name)
    assert "\n" not in str(e.value)
    if not name.endswith("big.json"):
        with pytest.raises(TinyrtError) as e:
            chat.save(name)
        assert "\n" not in str(e.value)
    assert chat.history == history
    assert not list(tmp_path.glob("*.tmp")) and os.path.exists("/dev/zero")


def test_a_model_without_a_chat_template(tiny, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = tinyrt.LLM(d, kv_size=256)
    chat = tinyrt.ChatSession(llm, max_tokens=8, temperature=0, ignore_eos=True)
    fed = Fed(llm)
    turn(chat, fed, "one")
    _, prompt = turn(chat, fed, "two")
    text = chat.template.render(chat.history, add_generation_prompt=False)
    assert text.startswith("<|im_start|>User: one\nAssistant:" + chat.history[1]["content"] + "\n")
    assert text.endswith("User: two\nAssistant:" + chat.history[3]["content"] + "\n")
    whole = llm.tokenizer.encode(chat.template.render(chat.history[:-1]), add_special=True)
    assert len(prompt) <= len(whole) - 20        # the second turn alone


def _saved(path, settings=None, messages=None, system=None):
    path.write_text(json.dumps({"format": "tinyrt-chat", "version": 1, "system": system,
                                "messages": messages or [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "yo"}],
                                "settings": settings or {}}))
    return path


@pytest.mark.parametrize("settings, words", [
    ({"seed": -5}, "seed"), ({"seed": 2**64}, "seed"), ({"stop": [1, 2]}, "stop"),
    ({"stop": "\ud800"}, "stop"), ({"top_k": 2.5}, "top_k"), ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"repeat_penalty": 1e-320}, "repeat_penalty"), ({"__class__": 1}, "__class__"),
])
def test_load_refuses_settings_it_cannot_use(tiny, tmp_path, settings, words):
    """A saved chat's settings are checked as every front end's options: a bad one is refused
    at /load, naming the file and the setting, and the session stays as it was."""
    chat = tinyrt.ChatSession(tinyrt.LLM(tiny, kv_size=256), max_tokens=4, temperature=0)
    list(chat.send("one"))
    history, before = chat.history, dict(chat.settings)
    path = _saved(tmp_path / "c.json", settings)
    with pytest.raises(TinyrtError) as e:
        chat.load(path)
    assert words in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    assert chat.history == history and chat.settings == before


def test_load_takes_settings_that_mean_something(tiny, tmp_path):
    """seed -1 (random), stop null (none), a temperature so small it is greedy, max_tokens
    null (the default): loaded, and the next turn runs on them."""
    llm = tinyrt.LLM(tiny, kv_size=256)
    chat = tinyrt.ChatSession(llm, max_tokens=4, temperature=0.7)
    chat.load(_saved(tmp_path / "c.json", {"seed": -1, "stop": None, "temperature": 1e-320,
                                           "max_tokens": None, "ignore_eos": True}))
    assert chat.settings["seed"] is None and chat.settings["temperature"] == 0.0
    reply = "".join(r.text for r in chat.send("two"))
    assert chat.last_finish == "length"               # (to the full cache: 512 is the default)
    greedy = tinyrt.ChatSession(llm, temperature=0, ignore_eos=True,
                                max_tokens=chat.last.generated_tokens)
    greedy.load(_saved(tmp_path / "d.json"))
    assert "".join(r.text for r in greedy.send("two")) == reply


def test_load_refuses_more_text_than_the_cache_could_hold(tiny, tmp_path):
    """A 20 MB message (under the file cap) is refused at /load, before it is tokenized (which
    would take gigabytes); as is text no tokenizer takes. The session stays as it was."""
    llm = tinyrt.LLM(tiny, kv_size=256)
    chat = tinyrt.ChatSession(llm, max_tokens=4, temperature=0)
    list(chat.send("one"))
    history = chat.history

    def no(*a, **k):
        raise AssertionError("tokenized")

    encode, llm.tokenizer.encode = llm.tokenizer.encode, no
    big = _saved(tmp_path / "big.json", messages=[{"role": "user", "content": "x" * 20_000_000}])
    with pytest.raises(TinyrtError, match="KV cache of 256 tokens"):
        chat.load(big)
    with pytest.raises(TinyrtError, match="not valid Unicode"):
        chat.load(_saved(tmp_path / "s.json", system="\udcff"))
    llm.tokenizer.encode = encode
    assert chat.history == history
    # what fits is taken, and a streaming cache takes more than its size (within a bound)
    chat.load(_saved(tmp_path / "ok.json", messages=[{"role": "user", "content": "x" * 4000}]))
    sink = tinyrt.ChatSession(tinyrt.LLM(tiny, kv_size=64, kv_policy="sink"), max_tokens=2)
    sink.load(_saved(tmp_path / "long.json", messages=[{"role": "user", "content": "ab " * 5000}]))
    list(sink.send("more"))
    assert sink.last.prompt_tokens > 64


def test_send_refuses_bad_settings_and_text(tiny):
    chat = tinyrt.ChatSession(tinyrt.LLM(tiny, kv_size=256), max_tokens=4, temperature=0)
    with pytest.raises(TinyrtError, match="top_k"):
        tinyrt.ChatSession(chat.llm, top_k=2.5)
    with pytest.raises(TinyrtError, match="temperature"):
        chat.configure(temperature=float("nan"))
    assert chat.settings["temperature"] == 0
    with pytest.raises(TinyrtError, match="seed"):
        list(chat.send("one", seed=-3))
    with pytest.raises(TinyrtError, match="not valid Unicode"):
        list(chat.send("a\ud800"))
    with pytest.raises(TinyrtError, match="KV cache of 256 tokens"):
        list(chat.send("y" * 100_000))
    assert chat.messages == []
    chat.settings["stop"] = "x"                   # (set directly: checked at the next turn)
    list(chat.send("one"))
    assert len(chat.messages) == 2


# -- the command ---------------------------------------------------------------------------------

def test_piped_chat(tiny, tmp_path):
    lines = "hello\n/max-tokens 5\n\nsecond turn\n/stats\n/save {}\n".format(tmp_path / "c.json")
    p = subprocess.run([sys.executable, "-m", "tinyrt", "chat", "-m", str(tiny), "--temperature",
                        "0", "-n", "12"], input=lines, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["hello", "second turn"]
    assert saved["settings"]["max_tokens"] == 5
    for m in saved["messages"][1::2]:
        assert m["content"] in p.stdout
    assert "prefill" in p.stderr and "last reply: TTFT" in p.stderr
    # a dense cache too small for the conversation: a message, no traceback, the chat goes on
    p = subprocess.run([sys.executable, "-m", "tinyrt", "chat", "-m", str(tiny), "--kv-size", "80",
                        "-n", "30", "--ignore-eos"], input="one\ntwo\nthree\n/reset\nfour\n",
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "/reset to start over" in p.stderr and "conversation cleared" in p.stderr
    assert p.stderr.count("tokens · cache") >= 2


def test_piped_chat_survives_bad_input(tiny, tmp_path):
    """Piped lines that are not UTF-8 (or too long) are skipped with a note; /load of settings
    the chat cannot use or of a 20 MB message is refused in one note, within the memory bar;
    /temp with a bad value too; the chat goes on and its turns are answered."""
    bad = _saved(tmp_path / "bad.json", {"seed": -5, "stop": [1, 2]})
    big = _saved(tmp_path / "big.json", messages=[{"role": "user", "content": "x" * 20_000_000}])
    lines = (b"caf\xe9\n" + b"/load " + str(bad).encode() + b"\n/load " + str(big).encode()
             + b"\n/temp -1\n/temp 1e-320\n" + b"z" * (2 << 20) + b"\nhello\n/stats\n")
    p = run_tinyrt("chat", "-m", str(tiny), "-n", "4", input=lines)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert p.peak_bytes < HOSTILE_BYTES
    notes = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(notes) == 5, p.stderr
    assert "input line 1 is not valid UTF-8" in notes[0] and "0xe9" in notes[0]
    assert "bad.json" in notes[1] and "seed" in notes[1]
    assert "big.json" in notes[2] and "KV cache" in notes[2]
    assert "temperature" in notes[3]
    assert "input line 6 is over" in notes[4]
    assert "temperature = 0.0" in p.stderr and "last reply: TTFT" in p.stderr


def spawn_chat(model, tmp_path, *args):
    import pexpect

    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data"), TERM="xterm",
               PROMPT_TOOLKIT_NO_CPR="1")
    return pexpect.spawn(sys.executable, ["-m", "tinyrt", "chat", "-m", str(model), *args], env=env,
                         encoding="utf-8", timeout=120, dimensions=(50, 200))


def ready(c):
    """Wait for the input prompt (prompt_toolkit turns bracketed paste on as it starts reading),
    so that keys sent next go to it."""
    c.expect_exact("\x1b[?2004h")


def test_terminal_chat(tiny, tmp_path):
    """The real `tinyrt chat` in a pseudo-terminal: a turn, a two-line turn (trailing \\),
    Ctrl-C in the middle of a long reply, /save, /reset, /load, Ctrl-C at the prompt, Ctrl-D."""
    c = spawn_chat(tiny, tmp_path, "--kv-size", "4096", "--temperature", "0", "-n", "3000",
                   "--ignore-eos")
    c.expect("/help for commands")
    ready(c)
    c.sendline("/max-tokens 20")
    c.expect("max_tokens = 20")
    ready(c)
    c.sendline("hello")
    c.expect(r"20 tokens · cache \d+/4096")
    ready(c)
    c.sendline("/max-tokens 3000")
    ready(c)
    c.send("two \\\r")
    c.send("lines\r")
    time.sleep(0.3)
    c.sendcontrol("c")
    c.expect(r"\(stopped\)")
    ready(c)
    c.sendline(f"/save {tmp_path / 'c.json'}")
    c.expect("saved to")
    saved = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert [m["content"] for m in saved if m["role"] == "user"] == ["hello", "two \nlines"]
    assert 0 < len(saved[-1]["content"]) and len(saved) == 4
    ready(c)
    c.sendline("/reset")
    c.expect("conversation cleared")
    ready(c)
    c.sendline(f"/load {tmp_path / 'c.json'}")
    c.expect("loaded 4 messages")
    ready(c)
    c.send("typed but not sent")
    c.sendcontrol("c")
    ready(c)
    c.sendline("/stats")
    c.expect(r"finish stopped")
    ready(c)
    c.sendcontrol("d")
    c.expect(pexpect_eof())
    c.close()
    assert c.exitstatus == 0
    history = (tmp_path / "data" / "tinyrt" / "chat_history").read_text()
    assert "+two \n+lines" in history and "typed but not sent" not in history


def pexpect_eof():
    import pexpect

    return pexpect.EOF


@pytest.mark.real_model
def test_terminal_chat_remembers_the_first_turn(smol, tmp_path):
    """On the default model, greedy: the follow-up needs the first turn (a new conversation
    asked the same does not name the city)."""
    c = spawn_chat(smol, tmp_path, "--temperature", "0", "-n", "60")
    ready(c)
    c.sendline("Hi! My name is Tom and I live in Paris.")
    c.expect(r"tokens · cache \d+/\d+")
    ready(c)
    c.sendline("Which city do I live in?")
    c.expect(r"Which city do I live in\?")
    c.expect(r"tokens · cache \d+/\d+")
    follow_up = c.before
    ready(c)
    c.sendline("/reset")
    c.expect("conversation cleared")
    ready(c)
    c.sendline("Which city do I live in?")
    c.expect(r"Which city do I live in\?")
    c.expect(r"tokens · cache \d+/\d+")
    fresh = c.before
    ready(c)
    c.sendcontrol("d")
    c.expect(pexpect_eof())
    assert "Paris" in follow_up and "Paris" not in fresh
