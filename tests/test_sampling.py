import numpy as np
import pytest

from helpers import seeded_rng
from tinyrt.errors import TinyrtError
from tinyrt.sampling import Sampler, SamplingParams, apply_repeat_penalty, filtered_probs


def _logits(n=1000):
    return seeded_rng().standard_normal(n).astype(np.float32) * 3


def test_greedy_is_argmax():
    for _ in range(20):
        x = _logits()
        assert Sampler(SamplingParams(temperature=0))(x) == int(np.argmax(x))


def test_top_k_one_is_greedy_at_any_temperature():
    x = _logits()
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, top_p=1.0, min_p=0.0))
    assert {s(x) for _ in range(50)} == {int(np.argmax(x))}


def test_seed_reproduces_draws():
    x = _logits()
    p = SamplingParams(temperature=1.0, seed=1234)
    a = [Sampler(p)(x) for _ in range(3)]
    s1, s2 = Sampler(p), Sampler(p)
    assert [s1(x) for _ in range(30)] == [s2(x) for _ in range(30)]
    assert len(set(a)) == 1


def test_filters_keep_what_they_promise():
    x = _logits()
    order = np.argsort(-x)
    probs = np.exp(x - x.max()); probs /= probs.sum()
    ids, p = filtered_probs(x, SamplingParams(temperature=1.0, top_k=10, top_p=1.0, min_p=0.0))
    assert set(ids) == set(order[:10]) and p.sum() == pytest.approx(1)
    ids, _ = filtered_probs(x, SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0))
    mass_before_last = probs[order[:len(ids) - 1]].sum()
    assert mass_before_last < 0.5 <= probs[order[:len(ids)]].sum()
    ids, _ = filtered_probs(x, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1))
    assert set(ids) == set(np.nonzero(probs >= 0.1 * probs.max())[0])


def test_draws_follow_the_distribution():
    x = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    counts = np.bincount([s(x) for _ in range(20000)], minlength=3) / 20000
    # 5 sigma of a binomial at n = 20000 is below 0.018
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.018)


def test_repeat_penalty():
    x = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    y = apply_repeat_penalty(x, [0, 1, 1], 2.0, 64)
    np.testing.assert_allclose(y, [1.0, -4.0, 1.0, 0.5])
    np.testing.assert_allclose(apply_repeat_penalty(x, [0, 1], 2.0, 1), [2.0, -4.0, 1.0, 0.5])
    assert x[0] == 2.0  # input untouched


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=-3), dict(repeat_penalty=0)])
def test_bad_params(bad):
    with pytest.raises(TinyrtError):
        SamplingParams(**bad)


def test_presence_and_frequency_penalties_count_the_window():
    rng = seeded_rng()
    x = rng.standard_normal(50).astype(np.float32)
    history = list(rng.integers(0, 50, 200))
    y = apply_repeat_penalty(x, history, 1.0, 64, presence=0.5, frequency=0.25)
    window = history[-64:]
    want = x.copy()
    for i in range(50):
        n = window.count(i)
        want[i] -= (0.5 if n else 0.0) + 0.25 * n
    np.testing.assert_allclose(y, want, rtol=1e-6)
    both = apply_repeat_penalty(x, history, 1.5, 64, presence=0.5)
    seen = np.isin(np.arange(50), window)
    np.testing.assert_allclose(both[seen], np.where(x > 0, x / 1.5, x * 1.5)[seen] - 0.5, rtol=1e-6)
    sampler = Sampler(SamplingParams(temperature=0, frequency_penalty=2.0))
    assert sampler.history_size == 64
    top = int(np.argmax(x))
    assert sampler(x, [top] * 10) != top                       # greedy, pushed off its argmax
    with pytest.raises(TinyrtError):
        SamplingParams(presence_penalty=2.5)


def test_a_tiny_temperature_is_the_greedy_limit():
    x = _logits()
    for t in (1e-320, 1e-30):
        assert Sampler(SamplingParams(temperature=t, top_k=0, top_p=1.0, min_p=0.0))(x) == \
            int(np.argmax(x))


# -- the one check of every generation setting (sampling.check_settings) -------------------------

import dataclasses
import math
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyrt.sampling import (ALIASES, DEFAULT_REPEAT_PENALTY, DEFAULT_TEMPERATURE,
                             MIN_TEMPERATURE, OPTIONS, RULES, SettingError, check_settings,
                             check_value)

EXAMPLES = int(os.environ.get("TINYRT_FUZZ_EXAMPLES", "500"))
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                derandomize=not os.environ.get("TINYRT_FUZZ_EXAMPLES"),
                suppress_health_check=[HealthCheck.too_slow])

# values of every type a caller, a JSON file or a command line may hand over; the edges of the
# ranges (and past them: what overflows, what divides to inf) often
EDGES = st.sampled_from([0, -0.0, 5e-324, 1e-320, 1e-300, 1e-30, 1e-5, 0.01, 1, 2, 100, 1e300,
                         -1, -2, 2**63, 2**64, 10**400 // 10**300, float("nan"), float("inf"),
                         -float("inf")])
ANY = st.one_of(
    EDGES, st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True), st.text(max_size=8),
    st.lists(st.one_of(st.text(max_size=8), st.integers(), st.none()), max_size=20),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from([np.float32(0.5), np.int64(3), np.bool_(True), "\ud800", ["\udcff"], [""]]))
SAMPLING = [f for f in SamplingParams.__dataclass_fields__]


@fuzz
@given(st.fixed_dictionaries({}, optional={k: ANY for k in (*OPTIONS, "repeat_last_n", "top-k")}),
       st.integers(0, 2**32 - 1))
def test_every_setting_is_usable_or_refused_in_one_line(options, seed):
    """Whatever the values, check_settings either refuses one with a one-line SettingError
    naming it, or returns settings the sampler uses together (a token drawn from random logits,
    with a history for the penalties, greedily and at a temperature)."""
    usable = {}
    for key, value in options.items():
        try:
            check_settings({key: value})
            usable[key] = value
        except SettingError as e:
            assert e.name == key and key in str(e) and "\n" not in str(e), (key, value, str(e))
    if usable != options:                       # the whole refused as its parts were
        with pytest.raises(SettingError) as e:
            check_settings(options)
        assert e.value.name in set(options) - set(usable)
    options = usable
    got = check_settings(options)
    assert set(got) == set(options) <= set(OPTIONS)
    for key, value in got.items():
        if value is None:
            continue
        if key == "stop":
            assert isinstance(value, list) and all(isinstance(s, str) and s for s in value)
        elif key == "ignore_eos":
            assert type(value) is bool
        else:
            integer = RULES[key][0]
            assert type(value) is (int if integer else float) and math.isfinite(value)
    params = SamplingParams(**{k: v for k, v in got.items() if k in SAMPLING and v is not None})
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(300) * rng.choice([0.01, 3, 30])).astype(np.float32)
    history = list(rng.integers(0, 300, 100))
    # greedy, and drawing too (at the temperature given, else 1): both paths read every value
    drawing = params if params.temperature else dataclasses.replace(params, temperature=1.0)
    for sampler in (Sampler(params), Sampler(drawing)):
        for _ in range(3):
            assert 0 <= sampler(logits, history) < 300
        dist = sampler.distribution(logits, history)
        assert np.isfinite(dist).all() and dist.sum() == pytest.approx(1)


@fuzz
@given(st.sampled_from(SAMPLING), ANY)
def test_sampling_params_take_what_check_settings_takes(field, value):
    """SamplingParams checks each field with the same rules: the same values pass, the same
    fail (None is the default in check_settings; only the seed and the repeat penalty, whose
    default depends on the temperature, may be None in the params)."""
    try:
        want = check_value(field, value)
    except SettingError:
        with pytest.raises(SettingError):
            SamplingParams(**{field: value})
        return
    if want is None and field == "repeat_penalty":
        want = DEFAULT_REPEAT_PENALTY                 # (at the default temperature)
    elif want is None and field != "seed":
        with pytest.raises(SettingError):
            SamplingParams(**{field: value})
        return
    assert getattr(SamplingParams(**{field: value}), field) == want


def test_settings_as_they_come_from_every_front_end():
    """A tiny positive temperature is greedy (no division by it anywhere, the GPU's float32
    sampler included); seed -1 is a random seed (as llama.cpp); a stop string is a list of one;
    each refusal names the setting, as a flag when asked."""
    assert check_settings({"temperature": 1e-320})["temperature"] == 0.0
    assert check_settings({"temperature": MIN_TEMPERATURE})["temperature"] == MIN_TEMPERATURE
    assert SamplingParams(temperature=5e-324).temperature == 0.0
    assert check_settings({"seed": -1, "stop": "END", "top_k": np.int64(5)}) == \
        {"seed": None, "stop": ["END"], "top_k": 5}
    assert type(check_settings({"top_k": np.int64(5)})["top_k"]) is int
    for bad, words in [({"top_k": 2.5}, "--top-k"), ({"top_k": "40"}, "--top-k"),
                       ({"top_k": -1}, "--top-k"), ({"seed": -2}, "--seed"),
                       ({"seed": 2**64}, "--seed"), ({"temperature": float("inf")}, "--temperature"),
                       ({"temperature": 10**400}, "--temperature"), ({"top_p": 0}, "--top-p"),
                       ({"min_p": float("nan")}, "--min-p"), ({"repeat_penalty": 1e-300}, "--repeat-penalty"),
                       ({"max_tokens": 0}, "--max-tokens"), ({"max_tokens": True}, "--max-tokens"),
                       ({"stop": [1, 2]}, "--stop"), ({"stop": ["a\udcffb"]}, "--stop"),
                       ({"stop": ["x"] * 17}, "--stop"), ({"ignore_eos": "yes"}, "--ignore-eos"),
                       ({"bogus": 1}, "--bogus")]:
        with pytest.raises(SettingError) as e:
            check_settings(bad, flags=True)
        assert e.value.name == words and words in str(e.value) and "\n" not in str(e.value)


def test_other_runtimes_names_are_ours():
    """mlx-lm's temp, HF's max_new_tokens and repetition_penalty, OpenAI's
    max_completion_tokens: checked by our rules, returned under our names, refused under
    theirs. Two names for one setting: the later value that is not None counts (as
    ChatSession.send's options over its settings)."""
    got = check_settings({"temp": 0.5, "max_new_tokens": 7, "repetition_penalty": np.float32(1.5)})
    assert got == {"temperature": 0.5, "max_tokens": 7, "repeat_penalty": 1.5}
    assert check_settings({"max_completion_tokens": 9}) == {"max_tokens": 9}
    assert set(ALIASES.values()) <= set(OPTIONS)
    assert check_settings({"temperature": 0.5, "temp": 0.7})["temperature"] == 0.7
    assert check_settings({"temp": 0.7, "temperature": None})["temperature"] == 0.7
    for bad, name in [({"temp": -1}, "temp"), ({"max_new_tokens": 0}, "max_new_tokens"),
                      ({"repetition_penalty": "x"}, "repetition_penalty")]:
        with pytest.raises(SettingError) as e:
            check_settings(bad)
        assert e.value.name == name and str(e.value).startswith(f"{name} must be")


@pytest.mark.parametrize("name, flags, words", [
    ("tempreature", False, "unknown option 'tempreature' (did you mean 'temperature'?)"),
    ("max_token", False, "(did you mean 'max_tokens'?)"),
    ("top_q", False, "(did you mean 'top_"),
    ("tempreature", True, "unknown option '--tempreature' (did you mean '--temperature'?)"),
    ("bogus", False, "unknown option 'bogus' (the options: max_tokens, temperature"),
])
def test_an_unknown_option_is_refused_naming_the_closest(name, flags, words):
    with pytest.raises(SettingError) as e:
        check_settings({"temperature": 0, name: 1}, flags=flags)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_default_samples_with_a_repeat_penalty_and_greedy_has_none():
    """The defaults (a low temperature for small models, llama.cpp's top-k and min-p, ollama's
    repeat penalty) sample; temperature 0 is the plain argmax, with no penalty unless one is
    asked for."""
    p = SamplingParams()
    assert p.temperature == DEFAULT_TEMPERATURE > 0 and p.repeat_penalty == DEFAULT_REPEAT_PENALTY > 1
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.2, 40, 0.9, 0.05)
    assert SamplingParams(temperature=0).repeat_penalty == 1.0
    assert SamplingParams(temperature=1e-320).repeat_penalty == 1.0       # (greedy too)
    assert SamplingParams(temperature=0, repeat_penalty=1.3).repeat_penalty == 1.3
    assert SamplingParams(temperature=0.5, repeat_penalty=1.0).repeat_penalty == 1.0
    x = _logits(50)
    top = int(np.argmax(x))
    assert Sampler(SamplingParams(temperature=0))(x, [top] * 10) == top   # not pushed off it
