"""ChatSession and `tinyrt chat`: multi-turn reuse of the KV cache, stopping a reply, the cache
policies, saving, and the real command driven in a pseudo-terminal and through a pipe."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

import tinyrt
from helpers import (HOSTILE_BYTES, byte_level_tokenizer, random_weights, run_tinyrt, seeded_rng,
                     tiny_config, write_tiny_model)
from tinyrt import chat as chat_module
from tinyrt.cli import build_parser
from tinyrt.cli import chat as chat_cli
from tinyrt.errors import CacheFullError, TinyrtError
from tinyrt.sampling import DEFAULT_MAX_TOKENS, SamplingParams

rng = seeded_rng(__name__)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("chat") / "m", tiny_config(), seed=5)


# what the `talker` model says, greedy, over and over: its tokens (byte-level BPE, Ġ a space)
TALK = ["ĠHe", "Ġju", "mp", "s", "Ġf", "or", "Ġcaf", "e", "Ġ", "ove", "r", "Ġlaz", "y", "Ġd", "og",
        "."]
SAYS = " He jumps for cafe over lazy dog."


@pytest.fixture(scope="module")
def talker(tmp_path_factory):
    """The tiny model made to say SAYS again and again (greedy), so that a screen can be read:
    attention and the MLP add nothing, each of TALK's tokens has an embedding dimension of its
    own, which lm_head maps to the next one's logit, and every other token's leads to the first."""
    cfg = tiny_config()
    vocab = byte_level_tokenizer(cfg["vocab_size"]).get_vocab()
    ids = [vocab[t] for t in TALK]
    w = random_weights(cfg)
    for name, weight in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weight[:] = 0
        elif name.endswith("norm.weight"):
            weight[:] = 1
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    embed[:], head[:] = 0, 0
    embed[:, 0], head[ids[0], 0] = 10, 10
    for i, t in enumerate(ids, 1):
        embed[t, 0], embed[t, i] = 0, 10
        head[ids[i % len(ids)], i] = 10
    return write_tiny_model(tmp_path_factory.mktemp("chat") / "talker", cfg, weights=w)


def test_the_talker_talks(talker):
    chat = tinyrt.ChatSession(tinyrt.LLM(talker, kv_size=256), max_tokens=2 * len(TALK),
                              temperature=0)
    assert "".join(r.text for r in chat.send("hi")) == SAYS * 2


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


def test_a_dense_chat_goes_on_past_its_cache_and_sink_keeps_it_all(tiny):
    """A dense cache the conversation fills: the oldest turns are left out (the system message
    stays), every turn is answered, and the model sees the newest turns as a fresh
    conversation of them would be tokenized; a message that alone does not fit is still a
    clear error. A sink cache keeps every turn's tokens, evicting."""
    llm = tinyrt.LLM(tiny, kv_size=96)
    chat = tinyrt.ChatSession(llm, system="S", max_tokens=30, temperature=0, ignore_eos=True)
    for i in range(10):
        assert len(list(chat.send(f"message number {i}"))) >= 2
        assert chat.last.prompt_tokens + chat.last.cached_tokens + 30 // 2 <= 96
    assert len(chat.messages) == 20 and chat.left_out >= 2 and chat.left_out % 2 == 0
    seen = [{"role": "system", "content": "S"}, *chat.messages[chat.left_out:-1]]
    assert chat.last.prompt_tokens + chat.last.cached_tokens == len(llm.encode(
        chat.template.render(seen, add_generation_prompt=True)))
    with pytest.raises(CacheFullError, match="room for"):
        list(chat.send("word " * 200))
    chat.reset()
    assert chat.history == [{"role": "system", "content": "S"}] and chat.left_out == 0
    assert "".join(r.text for r in chat.send("again"))
    sink = tinyrt.ChatSession(tinyrt.LLM(tiny, kv_size=96, kv_policy="sink"), max_tokens=30,
                              temperature=0, ignore_eos=True)
    for i in range(10):
        list(sink.send(f"message number {i}"))
    assert len(sink.messages) == 20 and sink.llm.cache.next_pos > 300 and sink.left_out == 0


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
    # a file or a link named as a temporary file of the save's would be: neither written nor
    # removed (the temporary file has a name of its own)
    (tmp_path / "c.json.tmp").write_text("the user's")
    (tmp_path / "elsewhere").write_text("the user's too")
    (tmp_path / "d.json.tmp").symlink_to(tmp_path / "elsewhere")
    for name in ("c.json", "d.json"):
        chat.save(tmp_path / name)
        other.load(tmp_path / name)
    assert (tmp_path / "c.json.tmp").read_text() == "the user's"
    assert (tmp_path / "elsewhere").read_text() == "the user's too"
    assert not list(tmp_path.glob(".*.tmp"))


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
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert os.path.exists("/dev/zero")


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


# -- rendering replies in a terminal -----------------------------------------------------------

def screen(output: str, width: int) -> tuple[list[str], int]:
    """What a terminal shows after `output`, as text lines (colours dropped), and the most lines
    the cursor went up at once (a live region drawn again). It knows the controls rich's Live
    region uses (carriage return, newline, cursor up, erase line); a line drawn past `width`
    (the terminal would wrap it where it falls, mid-word) fails."""
    lines, row, col, up, most_up = [""], 0, 0, 0, 0
    for tok in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\r|\n|"
                          r"[^\x1b\r\n]+", output):
        if tok == "\r":
            col = 0
        elif tok == "\n":
            row, col, up = row + 1, 0, 0
            lines += [""] * (row + 1 - len(lines))
        elif tok.startswith("\x1b[") and tok[-1] == "A":
            n = int(tok[2:-1] or 1)
            row, up = row - n, up + n
            most_up = max(most_up, up)
            assert row >= 0
        elif tok.startswith("\x1b[") and tok[-1] == "K":
            lines[row] = ""
        elif not tok.startswith("\x1b"):
            line = lines[row].ljust(col)
            lines[row] = line[:col] + tok + line[col + len(tok):]
            col += len(tok)
            assert col <= width, f"drawn past the width: {lines[row]!r}"
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return lines, most_up


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


MARKDOWN = """# Heading words

Some **bold words** and `inline code` in a paragraph long enough to wrap around twice at forty.

Here is code:
```python
def twice(x):
    return x * 2
```
After the code block.

1. first item
2. second item

- bullet one
- bullet two

Last paragraph without an end"""


def stream(text: str, pieces: list[int], *, markdown: bool = True, width: int = 40,
           height: int = 25, interval: float = 0.0, check=None) -> str:
    """`text` streamed in pieces of the given lengths through a terminal chat's Printer on a
    fake terminal; returns what was written to it."""
    from rich.console import Console

    f = io.StringIO()
    console = Console(file=f, width=width, height=height, force_terminal=True,
                      color_system="truecolor")
    reply = chat_cli.Printer(console, markdown=markdown, notes=console,
                             interval=interval).reply()
    at = 0
    for n in pieces:
        reply.write(text[at:at + n])
        at += n
        if check:
            check(reply)
    reply.write(text[at:])
    reply.close()
    return f.getvalue()


def random_pieces(n: int) -> list[int]:
    return list(rng.integers(1, 8, size=n))


def test_a_reply_renders_as_markdown_as_it_streams():
    """Pieces of a markdown reply (as tokens come): on the terminal, headings, emphasis, code
    and lists rendered (no markup left), each word whole on a line no wider than the terminal,
    every word once in order, the code highlighted; what stays on the screen is what rich
    draws for the whole reply at once."""
    from rich.console import Console
    from rich.markdown import Markdown

    f = io.StringIO()
    Console(file=f, width=40, force_terminal=True).print(Markdown(MARKDOWN))
    whole, _ = screen(f.getvalue(), 40)
    while not whole[0]:                      # (rich may start with a blank line)
        whole.pop(0)
    expected = words(re.sub(r"```\w*", "", MARKDOWN))
    for interval in (0.0, 1e9):              # every piece drawn; only the first and the end
        pieces = random_pieces(60)
        out = stream(MARKDOWN, pieces, interval=interval)
        shown, _ = screen(out, 40)
        text = "\n".join(shown)
        assert words(text) == expected, pieces
        assert not re.search(r"\*\*|```|^#|^- |^1\.", text, re.M), text
        assert "Heading words" in text and " • bullet one" in text and " 1 first item" in text
        assert re.search(r"^ +def twice\(x\):", text, re.M)          # a code block's margin
        assert re.search(r"\x1b\[[0-9;]*mdef\b", out)              # (a colour for `def`)
        assert shown == whole, pieces


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.8])
def test_a_stopped_reply_keeps_what_it_said(cut):
    """Ctrl-C ends a reply anywhere (in a word, in a code block): what came is on the screen,
    every word of it once."""
    text = MARKDOWN[:int(len(MARKDOWN) * cut)]
    pieces = random_pieces(len(text) // 8)
    shown, _ = screen(stream(text, pieces), 40)
    assert words("\n".join(shown)) == words(re.sub(r"```\w*", "", text)), pieces


def test_a_long_reply_draws_only_its_last_block():
    """Complete blocks are printed once and left; only the last, unfinished one is drawn
    again, and no more of it than fits the screen (a 30-line code block on a 12-line screen):
    a drawing costs one block, not the reply, and the screen does not scroll oddly."""
    para = "Words that make a paragraph of some length, " * 4
    code = "```\n" + "\n".join(f"line number {i} of the code" for i in range(30)) + "\n```\n"
    text = "\n\n".join([para, code, "- item\n- item", para] * 5)
    longest = max(len(para), len(code)) + 2
    seen = []

    def check(reply):
        seen.append(len(reply.tail))
        assert len(reply.tail) <= longest

    out = stream(text, [5] * (len(text) // 5), height=12, check=check)
    shown, most_up = screen(out, 40)
    assert words("\n".join(shown)) == words(text)
    assert most_up < 12 and max(seen) > len(para)   # (the code block was live, in part)


def test_plain_text_in_a_terminal_wraps_at_words():
    """--plain: the text as written (markup and all), its lines kept, wrapped between words."""
    text = ("A **line** of plain words long enough to wrap at least twice in forty columns.\n\n"
            "```\nsecond_line = 'kept'\n```\nlast words")
    shown, _ = screen(stream(text, random_pieces(40), markdown=False), 40)
    assert " ".join(shown).split() == text.split()
    assert shown[0].startswith("A **line**") and "```" in shown and shown[-1] == "last words"


def test_a_stopped_reply_is_marked():
    """A reply stopped in a terminal ends in a dim [stopped]: after its last words where they
    leave room, else (a full line, a code block's coloured one, no text at all) on a line of
    its own."""
    def stopped(text, markdown=True):
        from rich.console import Console

        f = io.StringIO()
        console = Console(file=f, width=40, height=25, force_terminal=True)
        reply = chat_cli.Printer(console, markdown=markdown, notes=console).reply()
        if text:
            reply.write(text)
        reply.close(stopped=True)
        assert "\x1b[2m[stopped]" in f.getvalue()
        return screen(f.getvalue(), 40)[0]

    assert stopped("Some **bold** words\n\nand more")[-1] == "and more [stopped]"
    assert stopped("x" * 35, markdown=False)[-2:] == ["x" * 35, "[stopped]"]
    assert stopped("- item\n- and a longer one")[-1] == " • and a longer one [stopped]"
    code = stopped("```\ncode\n")                  # (its last line a coloured margin)
    assert code[-1] == "[stopped]" and code[-3].strip() == "code"
    assert stopped("") == ["[stopped]"]


def test_a_stopped_reply_shows_what_the_conversation_keeps(talker, capsys):
    """A reply stopped while the stream holds text back (the start of a stop string): the
    conversation keeps the text of all its tokens, and that is what is shown."""
    chat = tinyrt.ChatSession(tinyrt.LLM(talker, kv_size=256), temperature=0, ignore_eos=True,
                              stop=HELD)
    asked = []

    def stopped():                               # (Ctrl-C after 20 tokens)
        asked.append(1)
        return len(asked) > 20

    chat_cli.reply(chat, "hi", chat_cli.Printer(None), stopped)
    kept = chat.history[-1]["content"]
    assert kept == (SAYS * 2)[:len(kept)] and len(kept) > len(SAYS) + 10
    assert capsys.readouterr().out == kept + "\n" and chat.last_finish is None


def test_keys_during_a_reply():
    """During a reply the terminal neither echoes nor edits lines, and Ctrl-C keeps what was
    typed; what is typed is read as it comes, without waiting when nothing was; Ctrl-D (the
    byte 0x04) stops the reply and quits, and what follows it is dropped. The terminal's
    settings come back whatever ends the reply (an error, a KeyboardInterrupt); a pipe is
    left alone."""
    import select
    import termios

    def typed(text):
        os.write(master, text)
        select.select([slave], [], [], 60)        # (the terminal passes it on)

    master, slave = os.openpty()
    try:
        before = termios.tcgetattr(slave)
        with chat_cli.Keys(slave) as keys:
            mode = termios.tcgetattr(slave)[3]
            assert not mode & (termios.ECHO | termios.ICANON) and mode & termios.NOFLSH
            assert not keys.stopped() and keys.typed == b""
            typed("déjà\x7f\x1b[D".encode())
            assert not keys.stopped() and keys.typed == "déjà\x7f\x1b[D".encode()
            keys.interrupt()                        # (Ctrl-C's signal handler)
            assert keys.stopped() and not keys.quit
            typed(b" vu")
        assert keys.typed.endswith(b" vu")           # (typed after the last token)
        assert termios.tcgetattr(slave) == before
        for error in (RuntimeError, KeyboardInterrupt):
            with pytest.raises(error), chat_cli.Keys(slave) as keys:
                typed(b"one\x04two")
                assert keys.stopped() and keys.quit and keys.typed == b"one"
                raise error
            assert termios.tcgetattr(slave) == before
    finally:
        os.close(master)
        os.close(slave)
    r, w = os.pipe()
    os.write(w, b"x\x04")
    with chat_cli.Keys(r) as keys:
        assert not keys.stopped()
    assert os.read(r, 10) == b"x\x04"
    os.close(r)
    os.close(w)


def test_piped_replies_are_plain_text(capsys):
    """Without a console (stdout not a terminal) a reply is the text as generated, then a line
    end; nothing else on stdout."""
    reply = chat_cli.Printer(None).reply()
    for piece in ("# Title\n", "**bold** ", "x" * 100):
        reply.write(piece)
    reply.close()
    assert capsys.readouterr().out == "# Title\n**bold** " + "x" * 100 + "\n"
    chat_cli.Printer(None).reply().close(ended=False)           # (an error's note follows)
    assert capsys.readouterr().out == ""


def test_complete_blocks():
    """Where a streaming markdown reply is cut: before a block that begins at the margin after
    a blank line, a code block, or the line after one; never inside a code block or before an
    indented line (a list item's rest)."""
    cb = chat_cli.complete_blocks
    assert cb("one\n\ntwo") == 5 and cb("one\n\n") == 0 and cb("one\ntwo") == 0
    assert cb("para\n```py\ncode\n") == 5 and cb("para\n```py") == 0
    assert cb("```\na\n\nb\n") == 0 and cb("```\na\n\nb\n```\nnext") == 13
    assert cb("1. item\n\n   more of it") == 0 and cb("1. item\n\n2. item") == 9
    assert cb("~~~\n```\n\nx\n") == 0 and cb("```\n~~~\n\nx\n```\n\ny") == 16


# -- /set ----------------------------------------------------------------------------------------

@pytest.fixture
def with_config(tiny, tmp_path):
    """The tiny model with a generation_config.json that asks for temperature 0.6, top_p 0.9."""
    d = tmp_path / "g"
    shutil.copytree(tiny, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    return d


def test_set_shows_the_settings_in_effect(with_config, capsys):
    chat = tinyrt.ChatSession(tinyrt.LLM(with_config, kv_size=256), max_tokens=None,
                              top_k=7)
    chat_cli.command(chat, "/set", chat_cli.Printer(None))
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in
            capsys.readouterr().err.splitlines()}
    assert rows["temperature"] == ["0.6", "the model's generation_config.json"]
    assert rows["top_p"] == ["0.9", "the model's generation_config.json"]
    assert rows["top_k"] == ["7"]                              # the session's
    for key in ("min_p", "repeat_penalty"):                    # the sampler's own defaults
        value = getattr(SamplingParams(temperature=0.6, top_p=0.9), key)
        assert rows[key] == [str(value), "default"]
    assert rows["max_tokens"] == [str(DEFAULT_MAX_TOKENS), "default"]
    assert rows["seed"] == ["random"] and rows["stop"] == ["none"]


def test_the_banner_says_which_sampling_applies_and_where_from(with_config):
    chat = tinyrt.ChatSession(tinyrt.LLM(with_config, kv_size=256), top_k=7)
    assert chat_cli.sampling_line(chat) == (
        "sampling temperature 0.6, top_p 0.9 (the model's generation_config.json); top_k 7 "
        "(yours); min_p 0.05, repeat_penalty 1.1 (tinyrt's defaults) · /set to change")


def test_set_changes_a_setting_and_refuses_bad_values(with_config, capsys):
    chat = tinyrt.ChatSession(tinyrt.LLM(with_config, kv_size=256), ignore_eos=True)
    out = chat_cli.Printer(None)
    for line, key, value in [("/set temp 0", "temperature", 0.0), ("/set top-k 5", "top_k", 5),
                             ("/set --top_p 0.5", "top_p", 0.5), ("/set min_p 0.1", "min_p", 0.1),
                             ("/set repeat-penalty 1.3", "repeat_penalty", 1.3),
                             ("/set max_tokens 3", "max_tokens", 3), ("/set seed 9", "seed", 9),
                             ("/set stop the end", "stop", ["the end"]),
                             ("/set seed -1", "seed", None), ("/set stop default", "stop", None),
                             ("/top-p 0.7", "top_p", 0.7), ("/max-tokens 4", "max_tokens", 4)]:
        chat_cli.command(chat, line, out)
        assert chat.settings[key] == value, line
        assert capsys.readouterr().err.startswith(f"{key} = "), line
    chat_cli.command(chat, "/set temperature default", out)
    assert capsys.readouterr().err == ("temperature = 0.6 (the model's generation_config.json)\n")
    before = dict(chat.settings)
    for line, words_ in [("/set temperature -1", "temperature"), ("/set top_k 2.5", "top_k"),
                         ("/set top_p 0", "top_p"), ("/set max-tokens 0", "max_tokens"),
                         ("/set seed abc", "seed"), ("/set min_p", "min_p"),
                         ("/set nosuch 1", "nosuch"), ("/temp x", "temperature")]:
        chat_cli.command(chat, line, out)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words_ in err and err.count("\n") == 1, line
        assert chat.settings == before, line
    chat_cli.command(chat, "hello", out)                     # the turn runs on the settings
    assert chat.last.generated_tokens == 4


def test_chat_plain_flag():
    parse = build_parser().parse_args
    assert parse(["chat"]).markdown is True
    assert parse(["chat", "--plain"]).markdown is False
    assert parse(["chat", "--no-markdown"]).markdown is False


# -- the command ---------------------------------------------------------------------------------

def test_piped_chat(tiny, tmp_path):
    lines = "hello\n/max-tokens 5\n\nsecond turn\n/stats\n/save {}\n".format(tmp_path / "c.json")
    p = subprocess.run([sys.executable, "-m", "tinyrt", "chat", "-m", str(tiny), "--temperature",
                        "0", "-n", "12"], input=lines, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["hello", "second turn"]
    assert saved["settings"]["max_tokens"] == 5
    # stdout is the replies as generated, each ended by a line end, and nothing else (scripts
    # read it): no rendering, no colour
    assert p.stdout == "".join(m["content"] + "\n" for m in saved["messages"][1::2])
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
    # (codec_errors: the terminal's echo of a key, ^C, can land between the bytes of a character
    # the reply is writing)
    return pexpect.spawn(sys.executable, ["-m", "tinyrt", "chat", "-m", str(model), *args], env=env,
                         encoding="utf-8", codec_errors="replace", timeout=120,
                         dimensions=(50, 200))


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
    c.sendline("/set top-k 5")
    c.expect("top_k = 5")
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
    c.expect_exact(chat_cli.STOPPED)
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


# a stop string that the talker's text keeps starting: the stream holds back the sentence it is
# in, which the conversation keeps all the same when the reply is stopped
HELD = SAYS.strip() + "!"


def talk(talker, tmp_path):
    """The talker in a terminal chat, with a reply that goes on until it is stopped."""
    return spawn_chat(talker, tmp_path, "--temperature", "0", "--ignore-eos", "-n", "1000000",
                      "--kv-policy", "sink", "--kv-size", "256", "--stop", HELD)


def test_terminal_chat_keys_during_a_reply(talker, tmp_path):
    """Keys typed during a reply, then Ctrl-C: nothing echoed (an echo in the reply's live
    region made its redrawing leave a line twice), the reply on the screen once, as the
    conversation keeps it (what the stream held back too), marked [stopped]; the keys wait in
    the next prompt, and Enter sends them."""
    c = talk(talker, tmp_path)
    ready(c)
    seen = io.StringIO()
    c.logfile_read = seen
    c.sendline("hello")
    c.expect("jumps")
    c.send("next question")
    c.sendcontrol("c")
    c.expect_exact(chat_cli.STOPPED)
    c.expect(r"tokens · cache")
    ready(c)
    c.expect_exact("next question")                  # in the prompt
    c.send("\r")
    c.expect("jumps")
    c.sendcontrol("c")
    c.expect_exact(chat_cli.STOPPED)
    ready(c)
    c.sendline(f"/save {tmp_path / 'c.json'}")
    c.expect("saved to")
    ready(c)
    c.sendline("/exit")
    c.expect(pexpect_eof())
    c.close()
    assert c.exitstatus == 0
    saved = json.loads((tmp_path / "c.json").read_text())["messages"]
    assert [m["content"] for m in saved[::2]] == ["hello", "next question"]
    first = saved[1]["content"]
    assert first.startswith(SAYS)     # (and ends in a sentence, held back: the stop string's)
    # the first reply as drawn, from the prompt's end to the status line after it
    drawn = seen.getvalue().split("\x1b[?2004l", 1)[1].split("prefill")[0]
    assert "^C" not in drawn and "next" not in drawn, drawn
    shown, _ = screen(drawn, 200)
    assert words(" ".join(shown)) == words(first) + ["stopped"], shown
    assert shown[-1].endswith(chat_cli.STOPPED)


def test_terminal_chat_ctrl_d_during_a_reply(talker, tmp_path):
    """Ctrl-D during a reply stops it (kept, marked) and quits: exit 0, no traceback, and the
    terminal as it was (echo and line editing on)."""
    import termios

    c = talk(talker, tmp_path)
    ready(c)
    c.sendline("hello")
    c.expect("jumps")
    c.sendcontrol("d")
    c.expect_exact(chat_cli.STOPPED)
    c.expect(r"tokens · cache")
    c.expect(pexpect_eof())
    mode = termios.tcgetattr(c.child_fd)[3]
    c.close()
    assert c.exitstatus == 0 and "Traceback" not in c.before, c.before
    assert mode & termios.ECHO and mode & termios.ICANON


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


@pytest.mark.parametrize("typed", ["\x1b[<0;1M", "\x1b[<35;1;1m", "\x1b[96;14;13M"])
def test_a_malformed_mouse_report_typed_at_the_prompt_is_ignored(typed, tmp_path, monkeypatch):
    """An escape sequence typed or pasted raw that reads as a mouse report prompt_toolkit
    cannot parse (its handler raises, which ended the prompt with "Press ENTER to continue"):
    the line typed after it is read."""
    from prompt_toolkit.application import create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from tinyrt.cli.chat import Terminal

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))         # (its history file)
    with create_pipe_input() as keys, create_app_session(input=keys, output=DummyOutput()):
        prompt = Terminal.__new__(Terminal)._prompt_session()
        keys.send_text(typed + "hello\r")
        assert prompt.prompt("> ") == "hello"
