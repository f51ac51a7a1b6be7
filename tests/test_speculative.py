"""Speculative decoding: greedy output is the target's own, sampling keeps the target's
distribution (chi-square tests with a stated false-alarm rate), drafters, caches and errors."""

import json

import numpy as np
import pytest

import tinyrt
from helpers import chi2_sf, fit_p, random_weights, seeded_rng, tiny_config, write_tiny_model
from tinyrt.errors import TinyrtError
from tinyrt.generate import Generation
from tinyrt.models import load_model
from tinyrt.sampling import Sampler, SamplingParams
from tinyrt.speculative import (LookupDrafter, ModelDrafter, SpeculativeGeneration, accept,
                                make_drafter)
from tinyrt.tokenizer import load_tokenizer

rng = seeded_rng(__name__)
ALPHA = 1e-3          # the false-alarm rate of every test here (of its chi-square tests together)


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


def assert_fits(**p_values: float) -> None:
    """Every chi-square test of one test passes at ALPHA / their number (Bonferroni: the test
    fails by chance at most at the rate ALPHA)."""
    assert min(p_values.values()) > ALPHA / len(p_values), p_values


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
    g = np.random.default_rng(int(rng.integers(1 << 30)))
    fixed = int(rng.integers(V))                  # the lookup drafter's proposal
    counts = np.zeros(V)
    for _ in range(N):
        if drafter == "model":
            x = int(g.choice(V, p=q))
            k, nxt = accept(np.stack([p, p]), q[None], [x], g)
        else:
            x = fixed
            k, nxt = accept(np.stack([p, p]), None, [x], g)
        counts[x if k == 1 else nxt] += 1
    assert counts[p == 0].sum() == 0
    assert fit_p(counts, N * p) > ALPHA, (counts / N, p)


def chain_speculation(drafter: str, N: int, L: int = 4, gamma: int = 3, V: int = 5):
    """The rule on its own in Leviathan's loop, over a target and a draft that are Markov chains
    on V tokens: p(. | a) = P[a] (each with a token the target never takes after a), a draft
    model's q(. | a) = Q[a], a deterministic draft's the target's likeliest token. N
    replies of L tokens after token 0, drafts of gamma tokens (fewer to end at L, so the first
    pass drafts gamma). Returns P, the replies [N, L] and how many drafts each first pass kept."""
    P = 0.8 * rng.dirichlet(np.ones(V) * 0.7, size=V) + 0.2 / V     # (no token near-certain)
    P[np.arange(V), rng.integers(V, size=V)] = 0.0
    P /= P.sum(axis=1, keepdims=True)
    Q = (P + rng.dirichlet(np.ones(V) * 0.7, size=V)) / 2      # (half its tokens the target's)
    D = P.argmax(axis=1)
    g = np.random.default_rng(int(rng.integers(1 << 30)))
    replies, kept = np.zeros((N, L), np.int64), np.zeros(N, np.int64)
    for t in range(N):
        out = [0]
        while len(out) <= L:
            drafts = []
            for _ in range(min(gamma, L - len(out))):
                a = (out + drafts)[-1]
                drafts.append(int(g.choice(V, p=Q[a])) if drafter == "model" else int(D[a]))
            context = [out[-1], *drafts]          # the token before each draft, and the last
            q = Q[context[:-1]] if drafter == "model" else None
            k, nxt = accept(P[context], q, drafts, g)
            if len(out) == 1:
                kept[t] = k
            out += [*drafts[:k], nxt]
        replies[t] = out[1:]
    return P, replies, kept


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_acceptance_rule_after_accepted_drafts(drafter):
    """Drafts of 3 tokens, 20000 replies of 4 tokens: (a) where the first pass kept its first
    j drafts, the reply's token j (the next draft kept, or the residual or bonus draw) has the
    target's distribution given the token before it, for j = 1, 2, 3; (b) the replies have the
    target chain's joint distribution, and (c) each token its marginal."""
    N, L = 20000, 4
    P, replies, kept = chain_speculation(drafter, N, L)
    V = len(P)
    assert (kept >= 2).sum() > N // 20 and (kept < 2).sum() > N // 20     # both branches
    p_values = {}
    for j in (1, 2, 3):
        after = replies[kept >= j]
        counts = np.zeros((V, V))
        np.add.at(counts, (after[:, j - 1], after[:, j]), 1)
        p_values[f"token {j} after {j} kept"] = fit_p(counts, counts.sum(1, keepdims=True) * P)
    grid = np.indices((V,) * L).reshape(L, -1)                     # every reply [L, V**L]
    joint = P[0, grid[0]] * np.prod(P[grid[:-1], grid[1:]], axis=0)
    cells = np.ravel_multi_index(replies.T, (V,) * L)
    p_values["joint"] = fit_p(np.bincount(cells, minlength=V ** L), N * joint)
    marginal = joint.reshape((V,) * L)
    for i in range(L):
        m = marginal.sum(axis=tuple(a for a in range(L) if a != i))
        p_values[f"token {i}"] = fit_p(np.bincount(replies[:, i], minlength=V), N * m)
    assert_fits(**p_values)


def test_greedy_acceptance_is_argmax_agreement():
    g = seeded_rng()
    p = np.zeros((3, 5))
    p[0, 1] = p[1, 3] = p[2, 0] = 1.0
    q = np.zeros((2, 5))
    q[0, 1] = q[1, 2] = 1.0
    assert accept(p, q, [1, 2], g) == (1, 3)
    q[1, 3], q[1, 2] = 1.0, 0.0
    assert accept(p, q, [1, 3], g) == (2, 0)


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


def speculative(llm, ids, n, gamma, adapt=False, confidence=0.0, drafter=None, **sampling):
    """Drafts of exactly `gamma` tokens (a model drafter's confidence 0: it never stops sooner),
    by `drafter` (the LLM's by default: set `confidence` on it still)."""
    llm.cache.reset()
    if isinstance(llm.drafter, ModelDrafter):
        llm.drafter.confidence = confidence
    g = SpeculativeGeneration(llm.model, llm.cache, llm.tokenizer, ids,
                              Sampler(SamplingParams(**sampling)), drafter=drafter or llm.drafter,
                              gamma=gamma, max_gamma=max(gamma, 8), adapt=adapt, max_tokens=n,
                              eos_ids=())
    list(g)
    return list(g.tokens), g.timings.speculative


class Recorder:
    """A drafter that passes every call on to `drafter` and records, for each pass, the token
    it drafted after and the drafts (`proposed`) and how many the target kept (`kept`)."""

    def __init__(self, drafter):
        self.drafter, self.name = drafter, drafter.name
        self.proposed, self.kept = [], []

    def propose(self, token, gamma, choose):
        drafts, q = self.drafter.propose(token, gamma, choose)
        self.proposed.append((token, drafts))
        return drafts, q

    def commit(self, accepted):
        self.kept.append(len(accepted))
        self.drafter.commit(accepted)

    def __getattr__(self, name):                  # start, finish, lost
        return getattr(self.drafter, name)


class Replay:
    """A drafter that proposes what a `Recorder` recorded, after the same tokens, and touches
    no cache: the target alone reads the same passes."""

    name = "replay"

    def __init__(self, proposed):
        self.proposed = iter(proposed)

    def propose(self, token, gamma, choose):
        after, drafts = next(self.proposed)
        assert token == after
        return drafts, None

    def start(self, *args):
        pass

    commit = finish = lost = start


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
    accepted = rejected = 0
    for gamma in range(1, 9):
        got, s = speculative(llm, ids, 60, gamma, temperature=0)
        assert got == want, gamma
        assert s.target_steps < 60 and s.accepted <= s.drafted
        accepted, rejected = accepted + s.accepted, rejected + s.drafted - s.accepted
    if draft in ("near", "copy"):   # both branches of the rule ran (over all the gammas: a
        assert accepted and rejected    # close draft at times agrees with all 60 tokens)
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


def test_make_drafter_builds_every_kind(models):
    """Drafters come from one place, given the loaders and a maker of a cache of its own: the
    target's first layers and a copy of it on the target's cache (no cache made), another
    model on its own, prompt lookup; no draft where the cache cannot roll back (h2o)."""
    llm = tinyrt.LLM(models["target"], device="reference", kv_size=64)
    loaded, made = [], []

    def load(directory, backend):
        loaded.append(directory)
        return load_model(directory, backend)

    def new_cache(model):
        made.append(model)
        return "its own cache"

    def make(spec, cache=llm.cache):
        return make_drafter(spec, llm.model, llm.tokenizer, cache, new_cache, load,
                            load_tokenizer)

    assert isinstance(make("lookup"), LookupDrafter)
    for spec, name in [("layers:1", "layers:1"), (models["copy"], "copy")]:
        d = make(spec)
        assert d.shared and d.cache is llm.cache and d.name == name and not made
    assert loaded == [models["copy"]]
    d = make(str(models["near"]))
    assert not d.shared and d.cache == "its own cache" and made == [d.model] and d.name == "near"
    with pytest.raises(TinyrtError, match="N in layers:N is a number"):
        make("layers:x")
    h2o = tinyrt.LLM(models["target"], device="reference", kv_size=64, kv_policy="h2o").cache
    for spec in ("lookup", "layers:1", models["near"]):
        with pytest.raises(TinyrtError, match="does not work with --kv-policy h2o"):
            make(spec, h2o)


def test_which_drafts_read_the_targets_cache(models):
    """A copy of the target (same attention layout and embedding table) and the target's own
    first layers read its KV cache; a draft with other embeddings or another shape has its own."""
    for draft, shared in [("copy", True), ("layers:1", True), ("near", False), ("far", False)]:
        llm = tinyrt.LLM(models["target"], device="reference", kv_size=64,
                         draft=models.get(draft, draft))
        assert llm.drafter.shared == shared, draft
        assert (llm.drafter.cache is llm.cache) == shared, draft


@pytest.mark.parametrize("policy, held", [("dense", 12), ("sink", 30), ("sink", 60)])
def test_a_draft_on_the_targets_cache_leaves_it_as_it_was(models, policy, held):
    """Drafting writes to the target's cache and takes it all back, also when the draft is
    interrupted (Ctrl-C) in the middle. Against a twin cache that saw the same tokens and no
    draft: the same positions in the same slots with the same K and V, but for what the
    target's next pass sets anyway: the sinks' keys (rotated for the draft's last position)
    and, once a sink cache's ring wrapped (60 tokens; 30: the window moved, the ring did not),
    slack slots whose tokens attention no longer reads. After that pass on both, the two are
    identical bit for bit, and so are the pass's logits."""
    kw = dict(device="reference", kv_size=24, kv_policy=policy)
    llm = tinyrt.LLM(models["target"], draft=models["copy"], **kw)
    twin = tinyrt.LLM(models["target"], draft="lookup", **kw)     # (the same slack)
    d, cache, other = llm.drafter, llm.cache, twin.cache
    for x in (llm, twin):
        x.model.forward(list(range(5, 5 + held)), x.cache)
    wraps = held > cache.capacity
    d.confidence = 0.0

    def state(c):
        return c.next_pos, c.length, c.span, c.slot_positions().copy()

    def interrupted(logits, drafts):
        if len(drafts) == 2:
            raise KeyboardInterrupt
        return int(np.argmax(logits)), None, 1.0

    for draft in ("whole", "interrupted"):
        before = state(cache)
        if draft == "whole":
            drafts, _ = d.propose(8, 4, lambda logits, drafts: (int(np.argmax(logits)), None, 1.0))
            assert len(drafts) == 4
        else:
            with pytest.raises(KeyboardInterrupt):
                d.propose(8, 4, interrupted)
        assert cache.next_pos == other.next_pos
        if not wraps:
            assert _same(state(cache), before) and _same(state(cache), state(other))
        differ = cache.slot_pos != other.slot_pos
        # (the interrupted draft takes the slots the pass before gave back: nothing to forget)
        assert differ.any() == (wraps and draft == "whole")
        assert (cache.slot_pos[differ] == -1).all()
        assert (other.slot_pos[differ] < cache.next_pos - getattr(cache, "window", 0)).all()
        kept = ~differ & (cache.slot_pos >= cache.n_sink)        # held slots but the sinks
        for buf in ("k", "v"):
            assert np.array_equal(getattr(cache, buf)[:, :, kept], getattr(other, buf)[:, :, kept])
        step = [8, 20, 21, 22, 23]                                # the target's next pass
        logits = [x.model.forward(step, x.cache, all_logits=True) for x in (llm, twin)]
        assert np.array_equal(*logits)
        assert _same(state(cache), state(other))
        assert np.array_equal(cache.k, other.k) and np.array_equal(cache.v, other.v)
        for c in (cache, other):
            c.rollback(3)                                         # (it kept a draft)


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
def test_default_model_greedy_with_its_awq_draft(smol, smol_awq):
    """The bar's pair: the float default model with its AWQ version as the draft."""
    target = tinyrt.LLM(smol, device="cpu", kv_size=512)
    llm = tinyrt.LLM(smol, device="cpu", kv_size=512, draft=smol_awq)
    assert llm.drafter.shared                    # a quantized copy: it reads the target's cache
    ids = target.prompt_ids("Give me three tips for learning a new language.")
    want = plain(target, ids, 40, temperature=0)
    for gamma in range(1, 9):
        got, s = speculative(llm, ids, 40, gamma, temperature=0)
        assert got == want, gamma
        assert s.accepted > 0


def test_sampling_keeps_the_targets_distribution(models):
    """The second and third sampled tokens of 1500 seeded replies, with and without a draft
    (of one token: 3 tokens leave room for no more), compared by a chi-square homogeneity test
    per position."""
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


def target_rows(target, ids, reply, sampling) -> np.ndarray:
    """The distributions [len(reply), V] the target draws each token of `reply` (to prompt
    `ids`) from: its sampler's, given the tokens before."""
    target.cache.reset()
    logits = target.model.backend.to_numpy(
        target.model.forward([*ids, *reply[:-1]], target.cache, all_logits=True))
    sampler = Sampler(SamplingParams(**sampling))
    return np.array([sampler.distribution(x, [*ids, *reply[:i]])
                     for i, x in enumerate(logits[len(ids) - 1:])])


# a draft, its confidence (0: drafts of gamma tokens; 0.05: of 2 or 3 here) and the sampling
# options. A repeat penalty below 1 favours repeats: a draft often repeats an earlier draft, which
# the target's distribution after it must count in its history.
SAMPLED = {
    "top-p, min-p, repeat penalty": ("near", 0.0, dict(temperature=0.8, top_k=8, top_p=0.8,
                                                       min_p=0.2, repeat_penalty=0.5)),
    "early stop": ("near", 0.05, dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0)),
    "draft on the target's cache": ("copy", 0.0, dict(temperature=1.0, top_k=5, top_p=1.0,
                                                      min_p=0.0)),
}


@pytest.mark.parametrize("case", SAMPLED)
def test_sampled_drafts_of_several_tokens_keep_the_targets_distribution(models, case):
    """1500 seeded replies of 5 tokens, drafts of up to 3: each token of the replies, and each
    token the first pass gave after a draft it kept (token j where it kept drafts 1 .. j - 1),
    against the target's distribution given the tokens before (the target alone's)."""
    draft, confidence, sampling = SAMPLED[case]
    target = tinyrt.LLM(models["target"], device="reference", kv_size=64)
    llm = tinyrt.LLM(models["target"], device="reference", kv_size=64,
                     draft=models.get(draft, draft))
    ids, L, N = [7, 8, 9, 10], 5, 1500
    replies, kept, lengths, rows = [], [], [], {}
    for seed in range(N):
        recorder = Recorder(llm.drafter)
        reply, _ = speculative(llm, ids, L, 3, confidence=confidence, drafter=recorder,
                               seed=seed, **sampling)
        replies.append(reply)
        kept.append(recorder.kept[0])
        lengths.append(len(recorder.proposed[0][1]))
        if tuple(reply) not in rows:
            rows[tuple(reply)] = target_rows(target, ids, reply, sampling)
    replies, kept, lengths = np.array(replies), np.array(kept), np.array(lengths)
    V = llm.config.vocab_size
    # the first passes drafted 3 tokens (or fewer, stopping where the draft was unsure) and
    # kept 2 or more often
    assert (lengths == 3).any() and ((lengths < 3).any() if confidence else (lengths == 3).all())
    assert (kept >= 2).sum() > N // 10
    p_values = {}
    for j in range(L):
        sets = {f"token {j}": replies}
        if j >= 2:      # the first pass (after token 0) kept drafts 1 .. j - 1
            sets[f"token {j} after a kept draft"] = replies[kept >= j - 1]
        for name, chosen in sets.items():
            expected = np.sum([rows[tuple(r)][j] for r in chosen], axis=0)
            p_values[name] = fit_p(np.bincount(chosen[:, j], minlength=V), expected)
    assert_fits(**p_values)


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
    but for near ties). The whole output, and the cache at the end, are those of the target
    alone reading the same drafts (a draft on its cache leaves no trace in it)."""
    target = tinyrt.LLM(models["target"], kv_size=24, kv_policy="sink")
    llm = tinyrt.LLM(models["target"], kv_size=24, kv_policy="sink", draft=models[draft])
    ids = [11, 12, 13]
    want = plain(target, ids, 300, temperature=0)
    recorder = Recorder(llm.drafter)
    got, s = speculative(llm, ids, 300, 4, adapt=True, drafter=recorder, temperature=0)
    unmoved = 24 - len(ids) - 9                  # (a pass takes up to 8 drafts and a token)
    assert len(got) == 300 and got[:unmoved] == want[:unmoved]
    assert s.accepted > 0 and llm.cache.next_pos > 300
    alone = tinyrt.LLM(models["target"], kv_size=24, kv_policy="sink", draft="lookup")
    replay = Replay(recorder.proposed)
    again, _ = speculative(alone, ids, 300, 4, adapt=True, drafter=replay, temperature=0)
    assert again == got and next(replay.proposed, None) is None
    a, b = llm.cache, alone.cache
    assert (a.next_pos, a.length, a.span) == (b.next_pos, b.length, b.span)
    assert np.array_equal(a.slot_pos, b.slot_pos)
    assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)


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
                 "--draft", str(models["near"]), "-n", "20", "--ignore-eos", "--json",
                 "--temperature", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["timings"]["speculative"]
    assert out["tokens"] == 20 and s["drafted"] >= s["accepted"] > 0 and s["target_steps"] < 20
    assert main(["generate", "-m", str(models["target"]), "hello hello hello", "--raw",
                 "--draft", "lookup", "-n", "10", "--stats"]) == 0
    assert "draft lookup:" in capsys.readouterr().err
