"""Fuzzing every reader of outside input: each either reads the input or raises TinyrtError with a
one-line message; no other exception escapes, nothing hangs.

Inputs are valid files mutated (bytes flipped, inserted, cut; JSON values replaced) and inputs built
from scratch. The suite runs a bounded number of examples per reader; for a long campaign set
TINYRT_FUZZ_EXAMPLES (examples per reader), e.g. `TINYRT_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py`.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyrt.chat import FORMAT
from tinyrt.chat_template import ChatTemplate
from tinyrt.errors import TinyrtError
from tinyrt.models.config import ModelConfig
from tinyrt.models.weights import SafetensorsFile, WeightStore
from tinyrt.tokenizer import load_tokenizer

from helpers import CHATML, fuzz, random_weights, tiny_config, write_tiny_model

HANG_SECONDS = 60       # a call running longer is a hang (the bar: 10 s on a quiet machine)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def expect_clean(call) -> object:
    """Run `call`: a result, or our error with a one-line message; anything else fails the test,
    and so does a call still running after HANG_SECONDS (stopped where Python code runs)."""
    def hung(*_):
        raise AssertionError(f"still running after {HANG_SECONDS} s: a hang")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
    try:
        return call()
    except TinyrtError as e:
        msg = str(e)
        assert msg and "\n" not in msg.strip(), f"not a one-line message: {msg!r}"
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """`data` with a few bytes changed, inserted or deleted, or cut short."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "cut"]))
        i = draw(st.integers(0, max(0, len(b) - 1)))
        if kind == "flip" and b:
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and b:
            b[i] = draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, ord('"'), ord("{")]))
        elif kind == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del b[i:i + draw(st.integers(1, 16))]
        elif kind == "cut":
            del b[i:]
    return bytes(b)


@st.composite
def json_mutated(draw, doc):
    """`doc` with values replaced, keys dropped or added, at any depth."""
    if isinstance(doc, dict) and doc:
        doc = dict(doc)
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(sorted(doc)))
            action = draw(st.sampled_from(["replace", "drop", "recurse", "add"]))
            if action == "replace":
                doc[key] = draw(JSON)
            elif action == "drop":
                doc.pop(key, None)
            elif action == "add":
                doc[draw(st.text(max_size=8))] = draw(JSON)
            elif key in doc:
                doc[key] = draw(json_mutated(doc[key]))
            if not doc:
                break
        return doc
    if isinstance(doc, list) and doc:
        doc = list(doc)
        i = draw(st.integers(0, len(doc) - 1))
        doc[i] = draw(json_mutated(doc[i]) | JSON)
        return doc
    return draw(JSON)


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def tiny(workdir):
    return write_tiny_model(workdir / "tiny")


# -- config.json -------------------------------------------------------------------------------

@fuzz
@given(d=json_mutated(tiny_config()))
def test_config(d):
    expect_clean(lambda: ModelConfig.from_dict(d))


@fuzz
@given(raw=mutated(json.dumps(tiny_config()).encode()))
def test_config_file(workdir, raw):
    (workdir / "config.json").write_bytes(raw)
    expect_clean(lambda: ModelConfig.from_file(workdir / "config.json"))


# -- safetensors files and index ---------------------------------------------------------------

def _read_all(path: Path) -> None:
    f = SafetensorsFile(path)
    for k in f.keys():
        np.array(f.get(k))


@fuzz
@given(data=st.data())
def test_safetensors(tiny, workdir, data):
    raw = (tiny / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    choice = data.draw(st.sampled_from(["bytes", "header", "head"]))
    if choice == "bytes":
        raw = data.draw(mutated(raw))
    elif choice == "head":                       # the region a reader parses first
        raw = data.draw(mutated(raw[:8 + n + 64])) + raw[8 + n + 64:]
    else:
        text = json.dumps(data.draw(json_mutated(header))).encode()
        raw = len(text).to_bytes(8, "little") + text + raw[8 + n:]
    path = workdir / "fuzz.safetensors"
    path.write_bytes(raw)
    expect_clean(lambda: _read_all(path))


@fuzz
@given(index=json_mutated({"metadata": {"total_size": 1}, "weight_map": {
    "model.embed_tokens.weight": "model.safetensors", "lm_head.weight": "model.safetensors"}}))
def test_safetensors_index(tiny, workdir, index):
    d = workdir / "sharded"
    d.mkdir(exist_ok=True)
    if not (d / "model.safetensors").exists():
        os.symlink(tiny / "model.safetensors", d / "model.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_clean(lambda: WeightStore(d).keys())


# -- GGUF (through our reader, models/gguf.py, as `tinyrt convert` reads it) -------------------

@pytest.fixture(scope="module")
def gguf_bytes(workdir):
    from gguf_helpers import write_gguf
    from helpers import byte_level_tokenizer

    cfg = tiny_config(vocab_size=300, num_hidden_layers=1)
    path = workdir / "tiny.gguf"
    write_gguf(path, cfg, random_weights(cfg), byte_level_tokenizer(300).to_str(),
               chat_template=CHATML)
    return path.read_bytes()


def _read_gguf(path: Path) -> None:
    from tinyrt.converters.sources import open_source

    src = open_source(path)
    ModelConfig.from_dict(src.config)
    for name in src.shapes:
        np.array(src.get(name))


@fuzz
@given(data=st.data())
def test_gguf(gguf_bytes, workdir, data):
    head = data.draw(st.sampled_from([len(gguf_bytes), 4096]))   # anywhere, or in the metadata
    raw = data.draw(mutated(gguf_bytes[:head])) + gguf_bytes[head:]
    path = workdir / "fuzz.gguf"
    path.write_bytes(raw)
    expect_clean(lambda: _read_gguf(path))


# -- tokenizers ----------------------------------------------------------------------------------

def _tokenize(d: Path) -> None:
    tok = load_tokenizer(d)
    ids = tok.encode("Hello, world! <|im_start|>user 😀", add_special=True)
    tok.decode(ids)


@fuzz
@given(data=st.data())
def test_tokenizer_json(tiny, workdir, data):
    d = workdir / "tok"
    d.mkdir(exist_ok=True)
    doc = json.loads((tiny / "tokenizer.json").read_text())
    if data.draw(st.booleans()):
        text = json.dumps(data.draw(json_mutated(doc)))
    else:
        text = data.draw(mutated(json.dumps(doc).encode()[:2000])).decode("utf-8", "replace")
    (d / "tokenizer.json").write_text(text)
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(data.draw(json_mutated(cfg) | st.just(cfg))))
    expect_clean(lambda: _tokenize(d))


@pytest.fixture(scope="module")
def sp_model(workdir):
    import sentencepiece as spm

    from helpers import CORPUS

    d = workdir / "sp"
    d.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.splitlines()),
                                   model_prefix=str(d / "tokenizer"), vocab_size=120,
                                   model_type="bpe", minloglevel=2)
    return (d / "tokenizer.model").read_bytes()


@fuzz
@given(data=st.data())
def test_sentencepiece_model(sp_model, workdir, data):
    d = workdir / "spfuzz"
    d.mkdir(exist_ok=True)
    (d / "tokenizer.model").write_bytes(data.draw(mutated(sp_model)))
    expect_clean(lambda: _tokenize(d))


# -- chat templates ------------------------------------------------------------------------------

PIECES = ["{{ ", " }}", "{% ", " %}", "{%- ", " -%}", "for m in messages", "endfor", "if ", "else",
          "endif", "m['content']", "m.role", "messages[0]", "messages[-1]['content']", " + ", " * ",
          "'x'", "1000", "range(", ")", "|length", "|tojson", "|upper", "|join(',')", "loop.index",
          "raise_exception('no')", "bos_token", "eos_token", "add_generation_prompt", "set x = ",
          "x", "namespace(a=1)", ".__class__", ".__globals__", "cycler", "lipsum", "**", "9", "[",
          "]", "(", ",", "'", "\"", "macro f()", "endmacro", "f()", "recursive", "loop(m)",
          "strftime_now('%Y')", "|map(attribute='role')|list", "break", "continue"]


@fuzz
@given(parts=st.lists(st.sampled_from(PIECES) | st.text(max_size=5), max_size=24),
       messages=st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                "content": st.text(max_size=30)}), max_size=4))
def test_chat_template(parts, messages):
    def render():
        out = ChatTemplate("".join(parts), bos_token="<s>", eos_token="</s>").render(messages)
        assert isinstance(out, str)
    expect_clean(render)


@fuzz
@given(src=st.sampled_from([CHATML]).flatmap(lambda s: mutated(s.encode())))
def test_chat_template_mutated(src):
    expect_clean(lambda: ChatTemplate(src.decode("utf-8", "replace")).render(
        [{"role": "user", "content": "hi"}]))


# -- saved conversations ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def session(tiny):
    import tinyrt

    return tinyrt.ChatSession(tinyrt.load(tiny, device="reference", quiet=True))


@fuzz
@given(data=st.data())
def test_saved_conversation(session, workdir, data):
    good = {"format": FORMAT, "version": 1, "system": "be brief",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "settings": {"temperature": 0.7}}
    path = workdir / "conv.json"
    if data.draw(st.booleans()):
        path.write_text(json.dumps(data.draw(json_mutated(good))))
    else:
        path.write_bytes(data.draw(mutated(json.dumps(good).encode())))
    expect_clean(lambda: session.load(path))
