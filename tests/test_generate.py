"""The generation loop on a tiny random model: finish reasons, stop strings, limits, timings."""

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


# -- what the API refuses, before any work -------------------------------------------------------

def _untouched(llm, monkeypatch):
    """Fail the test if the model runs a forward pass or the tokenizer sees text."""
    def no(*a, **k):
        raise AssertionError("work done for a request that is refused")

    monkeypatch.setattr(llm.model, "forward", no)
    monkeypatch.setattr(llm.tokenizer, "encode", no)


@pytest.mark.parametrize("call, words", [
    (lambda llm: llm.generate("", raw=True), "empty"),
    (lambda llm: llm.generate([]), "empty"),
    (lambda llm: llm.generation([]), "empty"),
    (lambda llm: llm.complete([]), "empty"),
    (lambda llm: llm.generation([1, 320]), "[0, 320)"),
    (lambda llm: llm.generation([-1]), "[0, 320)"),
    (lambda llm: llm.generation("abc"), "list of integers"),
    (lambda llm: llm.generation([1.5, 2]), "list of integers"),
    (lambda llm: llm.generation([True]), "list of integers"),
    (lambda llm: llm.generation([2**70]), "list of integers"),
    (lambda llm: llm.generation([5], top_k=2.5), "top_k"),
    (lambda llm: llm.generation([5], top_k="40"), "top_k"),
    (lambda llm: llm.generate("hi", seed=-2), "seed"),
    (lambda llm: llm.generate("hi", temperature=float("nan")), "temperature"),
    (lambda llm: llm.generate("hi", max_tokens=0), "max_tokens"),
    (lambda llm: llm.generate("hi", stop=[1, 2]), "stop"),
    (lambda llm: llm.generate("hi", repeat_penalty=0), "repeat_penalty"),
    (lambda llm: llm.generate("hi", bogus=1), "unknown setting 'bogus'"),
    (lambda llm: llm.generate("a\ud800b"), "not valid Unicode"),
    (lambda llm: llm.generate("hi", system="\udcff"), "not valid Unicode"),
    (lambda llm: llm.generate("x" * 20_000), "KV cache of 64 tokens"),
])
def test_the_api_refuses_bad_input_in_one_line_before_any_work(tiny_llm, monkeypatch, call, words):
    from tinyrt.errors import TinyrtError

    _untouched(tiny_llm, monkeypatch)
    with pytest.raises(TinyrtError) as e:
        call(tiny_llm)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_usable_edge_settings_run(tiny_llm):
    """seed -1 (a random seed, as llama.cpp), a temperature so small it is greedy, a stop
    string given as a string, None for the defaults."""
    greedy = tiny_llm.generate("hi", max_tokens=6, temperature=0, ignore_eos=True)
    assert tiny_llm.generate("hi", max_tokens=6, temperature=1e-320, seed=-1, ignore_eos=True) \
        == greedy
    stop = greedy[2:4]
    assert stop
    text = tiny_llm.generate("hi", max_tokens=6, temperature=0, stop=stop, ignore_eos=True,
                             seed=None, top_k=None)
    assert text == greedy[:greedy.index(stop)]


def test_bad_generation_config_values_warn_and_take_the_default(tmp_path, capfd):
    """generation_config.json's values the sampler cannot use are left out with one line each
    on stderr (the model runs as without them); the usable ones are taken."""
    import json

    import tinyrt

    d = write_tiny_model(tmp_path / "m", tiny_config())
    (d / "generation_config.json").write_text(json.dumps(
        {"top_k": 2.5, "temperature": "hot", "top_p": -1, "min_p": 0.2, "repetition_penalty": None,
         "do_sample": True}))
    llm = tinyrt.LLM(d, kv_size=64)
    assert llm.sampling_defaults() == {"min_p": 0.2}
    assert llm.sampling_defaults() == {"min_p": 0.2}          # (warned once)
    llm.generate("hi", max_tokens=3)
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 3 and all(line.startswith("warning: ") for line in err), err
    for name in ("top_k", "temperature", "top_p"):
        assert sum(name in line and "generation_config.json" in line for line in err) == 1
