"""The generation loop on a tiny random model: finish reasons, stop strings, limits, timings."""

import numpy as np
import pytest

from helpers import tiny_config, write_tiny_model
from tinyrt.errors import CacheFullError
from tinyrt.generate import Generation, StopStrings
from tinyrt.sampling import Sampler, SamplingParams


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    import tinyrt

    d = write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", tiny_config(), seed=11)
    return tinyrt.LLM(d, kv_size=64)


def _run(llm, prompt_ids, **kw):
    kw.setdefault("max_tokens", 20)
    kw.setdefault("eos_ids", ())
    llm.cache.reset()
    g = Generation(llm.model, llm.cache, llm.tokenizer, prompt_ids,
                   Sampler(SamplingParams(temperature=0)), **kw)
    return g, list(g)


def test_max_tokens_and_timings(tiny_llm):
    g, rs = _run(tiny_llm, [5, 6, 7], max_tokens=9)
    assert rs[-1].finish_reason == "length" and all(r.finish_reason is None for r in rs[:-1])
    assert len(g.tokens) == 9 and [r.token for r in rs[:-1]] == list(g.tokens)
    t = rs[-1].timings
    assert t.prompt_tokens == 3 and t.generated_tokens == 9 and t.decode_steps == 8
    assert t.ttft_s > 0 and t.prefill_tok_s > 0 and t.decode_tok_s > 0
    assert "".join(r.text for r in rs) == tiny_llm.tokenizer.decode(list(g.tokens))


def test_eos_stops_without_text(tiny_llm):
    g, rs = _run(tiny_llm, [5, 6, 7], max_tokens=9)
    third = g.tokens[2]
    g2, rs2 = _run(tiny_llm, [5, 6, 7], max_tokens=9, eos_ids=[third])
    assert g2.tokens == g.tokens[:2] and rs2[-1].finish_reason == "stop"


def test_stop_string_cuts_the_reply(tiny_llm):
    g, rs = _run(tiny_llm, [5, 6, 7], max_tokens=30)
    full = "".join(r.text for r in rs)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    g2, rs2 = _run(tiny_llm, [5, 6, 7], max_tokens=30, stop=[stop])
    text = "".join(r.text for r in rs2)
    assert text == full[:full.index(stop)] and rs2[-1].finish_reason == "stop"


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(["END", "\n\n"])
    assert s.feed("abc E") == ("abc ", False)
    assert s.feed("N") == ("", False)
    assert s.feed("x") == ("ENx", False)
    assert s.feed("yy\n") == ("yy", False)
    assert s.feed("\nzz") == ("", True)
    assert StopStrings([]).feed("E") == ("E", False)


def test_prompt_longer_than_the_cache(tiny_llm):
    with pytest.raises(CacheFullError, match="prompt has 70 tokens.*room for 64"):
        _run(tiny_llm, list(range(70)))


def test_reply_stops_when_the_cache_is_full(tiny_llm):
    g, rs = _run(tiny_llm, list(range(60)), max_tokens=100)
    assert rs[-1].finish_reason == "length" and len(g.tokens) == 5  # 60 + 4 fill 64 slots


def test_api_stream_and_generate(tiny_llm):
    text = tiny_llm.generate("hello", max_tokens=5, temperature=0)
    rs = list(tiny_llm.stream("hello", max_tokens=5, temperature=0))
    assert "".join(r.text for r in rs) == text and rs[-1].finish_reason in ("length", "stop")
    raw = tiny_llm.prompt_ids("hello", raw=True)
    assert raw == tiny_llm.tokenizer.encode("hello")
    chat = tiny_llm.prompt_ids("hello")
    assert tiny_llm.tokenizer.decode(chat, skip_special=False) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_an_unknown_weight_type_is_refused_before_loading(tiny_llm, monkeypatch):
    """dtype is checked up front; a ValueError raised while loading stays a ValueError (a
    fault of the loader shows as one, not as a user's mistake)."""
    import tinyrt
    import tinyrt.api
    from tinyrt.errors import TinyrtError

    with pytest.raises(TinyrtError, match="unknown weight type 'f8'"):
        tinyrt.LLM(tiny_llm.directory, dtype="f8")

    def broken(*a, **k):
        raise ValueError("a fault inside the loader")

    monkeypatch.setattr(tinyrt.api, "load_model", broken)
    with pytest.raises(ValueError, match="fault inside"):
        tinyrt.LLM(tiny_llm.directory, dtype="f32")
