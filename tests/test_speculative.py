"""Speculative decoding: greedy output is the target's own, sampling keeps the target's
distribution (chi-square tests with a stated false-alarm rate), drafters, caches and errors."""

import json
import math

import numpy as np
import pytest

import tinyrt
from helpers import random_weights, tiny_config, write_tiny_model
from tinyrt.errors import TinyrtError
from tinyrt.generate import Generation
from tinyrt.sampling import Sampler, SamplingParams
from tinyrt.speculative import LookupDrafter, ModelDrafter, SpeculativeGeneration, accept

rng = np.random.default_rng()
ALPHA = 1e-3          # the false-alarm rate of every chi-square test here


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with df degrees of freedom (the regularized upper incomplete
    gamma function, from its power series)."""
    a, z = df / 2, x / 2
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total)


def homogeneity_p(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test that two count vectors come from one distribution (cells whose expected
    count is below 5 pooled)."""
    n = a + b
    order = np.argsort(n)
    small = np.cumsum(n[order] * min(a.sum(), b.sum()) / n.sum()) < 5
    pooled = lambda c: np.append(c[order][~small], c[order][small].sum())   # noqa: E731
    a, b = pooled(a), pooled(b)
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    exp_a = (a + b) * a.sum() / (a.sum() + b.sum())
    exp_b = (a + b) * b.sum() / (a.sum() + b.sum())
    stat = ((a - exp_a) ** 2 / exp_a + (b - exp_b) ** 2 / exp_b).sum()
    return chi2_sf(stat, len(a) - 1)


def test_chi2_sf_matches_known_quantiles():
    # tabulated critical values: P(X >= 10.828; df 1) = 1e-3, P(X >= 18.467; df 4) = 1e-3,
    # P(X >= 3.841; df 1) = 0.05, P(X >= 43.773; df 30) = 0.05
    for x, df, p in [(10.828, 1, 1e-3), (18.467, 4, 1e-3), (3.841, 1, 0.05), (43.773, 30, 0.05)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3)


# -- the acceptance rule ----------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_acceptance_rule_gives_the_target_distribution(drafter):
    """One draft token, 40000 times: the token the rule outputs (the draft when accepted, else
    the residual draw) has the target's distribution p, for random p and q."""
    V, N = 8, 40000
    p = rng.dirichlet(np.ones(V) * 0.7)
    q = rng.dirichlet(np.ones(V) * 0.7)
    p[rng.integers(V)] = 0.0                      # a token the target never takes
    p /= p.sum()
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                     seed=int(rng.integers(1 << 30))))
    fixed = int(rng.integers(V))                  # the lookup drafter's proposal
    counts = np.zeros(V)
    for _ in range(N):
        if drafter == "model":
            x = int(sampler.rng.choice(V, p=q))
            k, nxt = accept(lambda j: p, q[None], [x], sampler)
        else:
            x = fixed
            k, nxt = accept(lambda j: p, None, [x], sampler)
        counts[x if k == 1 else nxt] += 1
    assert counts[p == 0].sum() == 0
    expected = N * p
    live = expected > 0
    stat = ((counts[live] - expected[live]) ** 2 / expected[live]).sum()
    assert chi2_sf(stat, live.sum() - 1) > ALPHA, (counts / N, p)


def test_greedy_acceptance_is_argmax_agreement():
    sampler = Sampler(SamplingParams(temperature=0))
    p = np.zeros((3, 5))
    p[0, 1] = p[1, 3] = p[2, 0] = 1.0
    q = np.zeros((2, 5))
    q[0, 1] = q[1, 2] = 1.0
    assert accept(lambda j: p[j], q, [1, 2], sampler) == (1, 3)
    q[1, 3], q[1, 2] = 1.0, 0.0
    assert accept(lambda j: p[j], q, [1, 3], sampler) == (2, 0)


# -- tiny models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target; a draft close to it (its weights with 5 % noise: high acceptance); a copy
    of it (the same noise but for the embedding table, as a quantized copy keeps it: it reads
    the target's KV cache); an unrelated draft with another shape (low acceptance); one
    tokenizer."""
    root = tmp_path_factory.mktemp("spec")
    cfg = tiny_config()
    w = random_weights(cfg, seed=5)
    noisy = {k: (v + 0.05 * np.abs(v).mean() * rng.standard_normal(v.shape)).astype(np.float32)
             for k, v in w.items()}
    copy = {**noisy, "model.embed_tokens.weight": w["model.embed_tokens.weight"]}
    small = tiny_config(hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=3, num_key_value_heads=1)
    return {"target": write_tiny_model(root / "target", cfg, weights=w),
            "near": write_tiny_model(root / "near", cfg, weights=noisy),
            "copy": write_tiny_model(root / "copy", cfg, weights=copy),
            "far": write_tiny_model(root / "far", small, seed=9)}


def plain(llm, ids, n, **sampling):
    llm.cache.reset()
    g = Generation(llm.model, llm.cache, llm.tokenizer, ids,
                   Sampler(SamplingParams(**sampling)), max_tokens=n, eos_ids=())
    list(g)
    return list(g.tokens)


def speculative(llm, ids, n, gamma, adapt=False, confidence=0.0, **sampling):
    """Drafts of exactly `gamma` tokens (a model drafter's confidence 0: it never stops sooner)."""
    llm.cache.reset()
    if isinstance(llm.drafter, ModelDrafter):
        llm.drafter.confidence = confidence
    g = SpeculativeGeneration(llm.model, llm.cache, llm.tokenizer, ids,
                              Sampler(SamplingParams(**sampling)), drafter=llm.drafter,
                              gamma=gamma, max_gamma=max(gamma, 8), adapt=adapt, max_tokens=n,
                              eos_ids=())
    list(g)
    return list(g.tokens), g.timings.speculative


@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("draft", ["near", "copy", "far", "lookup", "layers:1"])
def test_greedy_output_is_the_targets_for_every_gamma(models, device, draft):
    target = tinyrt.LLM(models["target"], device=device, kv_size=256)
    llm = tinyrt.LLM(models["target"], device=device, kv_size=256,
                     draft=models.get(draft, draft))
    penalty = dict(temperature=0, repeat_penalty=1.5, repeat_last_n=16)
    while True:      # fresh ids whose penalized greedy reply differs from the plain one (about
        # 1 in 100 do not, and the penalized check below would then test nothing new)
        ids = [int(x) for x in rng.integers(3, 320, 12)] * 2       # repeats, for the lookup
        want = plain(target, ids, 60, temperature=0)
        penalized = plain(target, ids, 60, **penalty)
        if penalized != want:
            break
    for gamma in range(1, 9):
        got, s = speculative(llm, ids, 60, gamma, temperature=0)
        assert got == want, gamma
        assert s.target_steps < 60 and s.accepted <= s.drafted
        if draft in ("near", "copy"):
            assert 0 < s.accepted < s.drafted        # both branches of the rule ran
    got, s = speculative(llm, ids, 60, 4, adapt=True, temperature=0)
    assert got == want and 1 <= s.gamma <= 8
    got, s = speculative(llm, ids, 60, 12, adapt=True, confidence=0.3, temperature=0)
    assert got == want
    # with a repeat penalty, greedy tokens are the argmax of penalized logits (the drafts' too)
    got, s = speculative(llm, ids, 60, 4, adapt=True, confidence=0.3, **penalty)
    assert got == penalized != want


def test_a_draft_model_stops_where_it_is_unsure(models):
    """A draft ends at the token where the product of the draft's probabilities falls below
    its confidence; the target then takes what it ran of the draft back in step."""
    llm = tinyrt.LLM(models["target"], device="reference", kv_size=256, draft=models["near"])
    d = llm.drafter
    d.start([5, 6, 7], 0)
    probs = None

    def choose(logits, drafts):
        return 20 + len(drafts), np.zeros(4), next(probs)

    for confidence, n in [(0.42, 3), (0.0, 4), (1.0, 1)]:
        probs = iter([0.9, 0.5, 0.9, 0.9])
        d.confidence = confidence
        before = d.cache.next_pos
        drafts, q = d.propose(8, 4, choose)
        assert drafts == [20, 21, 22, 23][:n] and len(q) == n       # 0.9 * 0.5 * 0.9 < 0.42
        assert d.cache.next_pos == before + n          # 8 and the drafts but the last have run
        d.commit([])
        assert d.cache.next_pos == before + 1 and d.pending == []


def test_which_drafts_read_the_targets_cache(models):
    """A copy of the target (same attention layout and embedding table) and the target's own
    first layers read its KV cache; a draft with other embeddings or another shape has its own."""
    for draft, shared in [("copy", True), ("layers:1", True), ("near", False), ("far", False)]:
        llm = tinyrt.LLM(models["target"], device="reference", kv_size=64,
                         draft=models.get(draft, draft))
        assert llm.drafter.shared == shared, draft
        assert (llm.drafter.cache is llm.cache) == shared, draft


@pytest.mark.parametrize("policy", ["dense", "sink"])
def test_a_draft_on_the_targets_cache_leaves_it_as_it_was(models, policy):
    """Drafting writes to the target's cache and takes it all back: the cache holds what it
    held, also when the draft is interrupted (Ctrl-C) in the middle."""
    llm = tinyrt.LLM(models["target"], device="reference", kv_size=24, kv_policy=policy,
                     draft=models["copy"])
    d, cache = llm.drafter, llm.cache
    llm.model.forward(list(range(5, 5 + 30 if policy == "sink" else 5 + 12)), cache)

    def state():
        return cache.next_pos, cache.length, cache.span, cache.slot_positions().copy()

    before = state()
    d.confidence = 0.0
    drafts, _ = d.propose(8, 4, lambda logits, drafts: (int(np.argmax(logits)), None, 1.0))
    assert len(drafts) == 4 and _same(state(), before)

    def interrupted(logits, drafts):
        if len(drafts) == 2:
            raise KeyboardInterrupt
        return int(np.argmax(logits)), None, 1.0

    with pytest.raises(KeyboardInterrupt):
        d.propose(8, 4, interrupted)
    assert _same(state(), before)


def _same(a, b) -> bool:
    return a[:3] == b[:3] and np.array_equal(a[3], b[3])


def test_verification_rows_are_the_decode_steps_logits(models):
    """A float target's pass over a draft gives each position, to the bit, the logits a
    one-token decode step gives it (cpu: the few-token kernels compute what one token's do), so
    greedy speculation cannot flip a near-tie. (A 4-bit model's one-token step is a fused
    kernel, compiled apart: its last bits may differ.)"""
    path = models["target"]
    llm = tinyrt.LLM(path, device="cpu", kv_size=256)
    ids = [int(x) for x in rng.integers(3, 320, 40)]
    llm.model.forward(ids[:30], llm.cache)
    one = [llm.model.forward([t], llm.cache)[0] for t in ids[30:]]
    llm.cache.rollback(10)
    rows = llm.model.forward(ids[30:], llm.cache, all_logits=True)
    assert all(np.array_equal(a, b) for a, b in zip(one, rows))


@pytest.mark.real_model
def test_default_model_greedy_with_its_awq_draft(smol_f16, smol_awq):
    """The bar's pair: the float default model with its AWQ version as the draft."""
    target = tinyrt.LLM(smol_f16, device="cpu", kv_size=512)
    llm = tinyrt.LLM(smol_f16, device="cpu", kv_size=512, draft=smol_awq)
    assert llm.drafter.shared                    # a quantized copy: it reads the target's cache
    ids = target.prompt_ids("Give me three tips for learning a new language.")
    want = plain(target, ids, 40, temperature=0)
    for gamma in range(1, 9):
        got, s = speculative(llm, ids, 40, gamma, temperature=0)
        assert got == want, gamma
        assert s.accepted > 0


def test_sampling_keeps_the_targets_distribution(models):
    """The second and third sampled tokens of 1500 seeded replies, with and without a draft
    (gamma 3), compared by a chi-square homogeneity test per position."""
    target = tinyrt.LLM(models["target"], device="reference", kv_size=64)
    llm = tinyrt.LLM(models["target"], device="reference", kv_size=64, draft=models["near"])
    opts = dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0)
    ids, N = [7, 8, 9, 10], 1500
    counts = {k: np.zeros((2, 320)) for k in ("plain", "spec")}
    accepted = 0
    for seed in range(N):
        a = plain(target, ids, 3, seed=seed, **opts)
        b, s = speculative(llm, ids, 3, 3, seed=seed + N, **opts)
        accepted += s.accepted
        for pos in (1, 2):
            counts["plain"][pos - 1, a[pos]] += 1
            counts["spec"][pos - 1, b[pos]] += 1
    assert accepted > N // 2
    for pos in range(2):
        assert homogeneity_p(counts["plain"][pos], counts["spec"][pos]) > ALPHA


def test_lookup_drafter_proposes_what_followed_the_last_ngram():
    d = LookupDrafter()
    d.start([5, 6, 7, 8, 9, 5, 6], 0)
    assert d.propose(7, 3, None) == ([8, 9, 5], None)       # 5 6 7 seen before: 8 9 5 followed
    d.commit([8, 9])
    assert d.propose(4, 3, None) == ([], None)               # 4 never seen
    d.commit([])
    assert d.propose(9, 2, None) == ([4, 9], None)           # ... 9 4 9: the latest 9 before


@pytest.mark.parametrize("draft", ["near", "copy"])
def test_speculative_sink_cache_streams_across_wraparounds(models, draft):
    """A sink cache of 24 with a draft (its own cache or the target's): 300 tokens through many
    wrap-arounds; the output is the target's until a pass first moves the window (after it, the
    target reads each draft as it reads a prompt chunk, see kv_cache.SinkCache: the same tokens
    but for near ties)."""
    target = tinyrt.LLM(models["target"], kv_size=24, kv_policy="sink")
    llm = tinyrt.LLM(models["target"], kv_size=24, kv_policy="sink", draft=models[draft])
    ids = [11, 12, 13]
    want = plain(target, ids, 300, temperature=0)
    got, s = speculative(llm, ids, 300, 4, adapt=True, temperature=0)
    unmoved = 24 - len(ids) - 9                  # (a pass takes up to 8 drafts and a token)
    assert len(got) == 300 and got[:unmoved] == want[:unmoved]
    assert s.accepted > 0 and llm.cache.next_pos > 300


def test_chat_with_a_draft_is_the_chat_without(models):
    """Multi-turn reuse and replies cut by max_tokens (the caches give back what the caller did
    not take): the same replies as without a draft, on its own cache or the target's."""
    replies = []
    for draft in (None, models["near"], models["copy"]):
        llm = tinyrt.LLM(models["target"], kv_size=512, draft=draft)
        chat = tinyrt.ChatSession(llm, temperature=0)
        out = []
        for text, n in [("hello", 7), ("quick fox", 3), ("def f(x)", 11), ("naïve", 5)]:
            out.append("".join(r.text for r in chat.send(text, max_tokens=n)))
            if draft == models["near"]:      # kept step: it holds what the target holds
                d = llm.drafter
                assert d.synced == llm.cache.next_pos == d.cache.next_pos + len(d.pending)
        replies.append((out, llm.cache.next_pos))
    assert replies[0] == replies[1] == replies[2]


def test_draft_errors(models, tmp_path):
    with pytest.raises(TinyrtError, match="h2o"):
        tinyrt.LLM(models["target"], kv_policy="h2o", draft="lookup")
    with pytest.raises(TinyrtError, match="draft-tokens"):
        tinyrt.LLM(models["target"], draft="lookup", draft_tokens=0)
    with pytest.raises(TinyrtError, match="layers"):
        tinyrt.LLM(models["target"], draft="layers:2")
    big = write_tiny_model(tmp_path / "big", tiny_config(vocab_size=512), seed=1)
    with pytest.raises(TinyrtError, match="vocabulary .512 tokens. does not match the target's .320"):
        tinyrt.LLM(models["target"], draft=big)
    other = write_tiny_model(tmp_path / "other", tiny_config(), seed=1)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TinyrtError, match="token 100 is"):
        tinyrt.LLM(models["target"], draft=other)


def test_cli_generate_with_a_draft(models, capsys):
    from tinyrt.cli import main

    assert main(["generate", "-m", str(models["target"]), "hello hello hello", "--raw",
                 "--draft", str(models["near"]), "-n", "20", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["timings"]["speculative"]
    assert out["tokens"] == 20 and s["drafted"] >= s["accepted"] > 0 and s["target_steps"] < 20
    assert main(["generate", "-m", str(models["target"]), "hello hello hello", "--raw",
                 "--draft", "lookup", "-n", "10", "--stats"]) == 0
    assert "draft lookup:" in capsys.readouterr().err
