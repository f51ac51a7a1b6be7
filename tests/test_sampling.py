import numpy as np
import pytest

from tinyrt.errors import TinyrtError
from tinyrt.sampling import Sampler, SamplingParams, apply_repeat_penalty, filtered_probs


def _logits(n=1000):
    return np.random.default_rng().standard_normal(n).astype(np.float32) * 3


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
    rng = np.random.default_rng()
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
    sampler = Sampler(SamplingParams(frequency_penalty=2.0))
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
