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
    (lambda llm: llm.generate("hi", bogus=1), "unknown option 'bogus'"),
    (lambda llm: llm.generate("hi", tempreature=0.5), "(did you mean 'temperature'?)"),
    (lambda llm: llm.generation([5], max_new_token=3), "(did you mean 'max_new_tokens'?)"),
    (lambda llm: llm.complete([5], temp=-1), "temp must be"),
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


def test_other_runtimes_names_for_the_options(tiny_llm):
    """mlx-lm's temp, HF's max_new_tokens and repetition_penalty, OpenAI's
    max_completion_tokens: the reply is the one our names give, through every call."""
    ours = dict(temperature=0, max_tokens=6, repeat_penalty=1.5, ignore_eos=True)
    want = tiny_llm.generate("hi", **ours)
    assert tiny_llm.generate("hi", temp=0, max_new_tokens=6, repetition_penalty=1.5,
                             ignore_eos=True) == want
    assert "".join(r.text for r in tiny_llm.stream(
        "hi", temp=0, max_completion_tokens=6, repetition_penalty=1.5, ignore_eos=True)) == want
    ids = tiny_llm.prompt_ids("hi")
    replies = []
    for options in (ours, dict(temp=0, max_new_tokens=6, repetition_penalty=1.5, ignore_eos=True)):
        tiny_llm.reset()
        replies.append([r.token for r in tiny_llm.generation(ids, **options)
                        if r.token is not None])
    assert replies[0] == replies[1] and len(replies[0]) == 6


def _params(llm, **options):
    """The sampling settings a reply of `llm` runs on, with `options`."""
    return llm.generation([5], **options).sampler.params


def test_default_sampling_is_the_model_s_else_tinyrt_s(tiny_llm, tmp_path):
    """Without a generation_config.json: tinyrt's temperature 0.2 and top-p 0.9, llama.cpp's
    top-k and min-p and ollama's repeat penalty; temperature 0 is plain greedy. The model's settings come first, the caller's over them."""
    import json
    import shutil

    import tinyrt

    p = _params(tiny_llm)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty) == (0.2, 40, 0.9, 0.05, 1.1)
    assert _params(tiny_llm, temperature=0).repeat_penalty == 1.0
    assert _params(tiny_llm, temp=0.5).temperature == 0.5
    d = tmp_path / "m"
    shutil.copytree(tiny_llm.directory, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20,
                                                          "repetition_penalty": 1.05}))
    llm = tinyrt.LLM(d, kv_size=64)
    p = _params(llm)
    assert (p.temperature, p.top_k, p.top_p, p.repeat_penalty) == (0.6, 20, 0.9, 1.05)
    assert _params(llm, temperature=0).repeat_penalty == 1.05     # (the model asks for it)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    p = _params(tinyrt.LLM(d, kv_size=64))
    assert (p.temperature, p.repeat_penalty) == (0.0, 1.0)


def test_load_options_are_checked_before_anything_loads(tmp_path):
    """--threads (1 to the CPUs this process may use), --draft-tokens and the KV cache's sizes:
    refused naming the option before the model is looked for (it does not exist)."""
    import tinyrt
    from tinyrt.api import cpu_count
    from tinyrt.errors import TinyrtError

    missing = tmp_path / "no-model"
    for kw, words in [(dict(threads=0), "--threads"), (dict(threads=cpu_count() + 1), "CPUs"),
                      (dict(threads=1.5), "--threads"), (dict(draft_tokens=0), "--draft-tokens"),
                      (dict(draft_tokens=33), "--draft-tokens"), (dict(kv_size=0), "--kv-size"),
                      (dict(kv_size=-5), "--kv-size"), (dict(kv_size=2.5), "--kv-size"),
                      (dict(kv_size=1 << 40), "--kv-size"), (dict(sinks=-1), "--sinks"),
                      (dict(recent=0), "--recent"), (dict(kv_group=0), "--kv-group"),
                      (dict(kv_policy="sink", kv_size=8, sinks=8), "--sinks 8"),
                      (dict(kv_policy="h2o", kv_size=16, sinks=4, recent=13), "--recent 13"),
                      (dict(kv_szie=64), "did you mean 'kv_size'?")]:
        with pytest.raises(TinyrtError) as e:
            tinyrt.load(missing, **kw)
        assert words in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
    with pytest.raises(TinyrtError, match="--threads"):
        tinyrt.LLM(missing, threads=cpu_count() + 1)
