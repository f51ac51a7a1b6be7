"""Speculative decoding (Leviathan et al., 2023): a draft proposes gamma tokens, the target scores
them all in one forward pass (the prompt path), and an acceptance rule keeps exactly the target's
output distribution: draft token x, drawn from the draft's distribution q, stays with probability
min(1, p(x) / q(x)), p being the target's; the first one rejected is replaced by a draw from
norm(max(0, p - q)); when all gamma stay, the target's next distribution gives one token more.
Greedy decoding is the special case of one-hot p and q: the output is the target's own greedy
output, token for token. `accept` is the rule alone, a function of p, q and a random generator
(tested on its own); `SpeculativeGeneration` runs it, or for plain greedy decoding the argmax
comparison it comes to.

Drafters (`make_drafter` builds the one `--draft` names):
- `ModelDrafter`: a smaller model with the same vocabulary and its own KV cache, or the target's
  cache where it is a copy of the target (`shares_cache`: a quantized copy, its first layers);
- `LookupDrafter`: prompt lookup, no model: the tokens that followed the latest earlier
  occurrence of the context's last n-gram (replies that quote their input);
- a model's first layers with its final norm and head (`first_layers`), a derived draft.

How many tokens a draft proposes: at most gamma, a bound that adapts to what the target keeps
(one more after a pass that kept every draft, one fewer after one that kept less than half,
within 1 and `--draft-tokens`); a draft model stops sooner where the probability it gives its
whole draft (the product of its tokens' probabilities) falls below `DRAFT_CONFIDENCE`: a token
it is unsure of is likely rejected, and costs a draft step all the same. The bound is low because
a greedy target keeps more of a quantized copy's tokens than the copy's probabilities say
(docs/SPECULATIVE.md).

The caches roll back what the target rejects (a draft on the target's cache, its drafts too); a
sink cache keeps gamma + 1 slots of slack for that (kv_cache.SinkCache). The h2o policy cannot
roll back an eviction (its `can_rollback` is False), so it takes no draft.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from tinyrt.errors import TinyrtError, shown

from .generate import Generation
from .sampling import check_logits, draw

MAX_GAMMA = 12          # the default bound of the drafts' length (--draft-tokens)
DRAFT_CONFIDENCE = 0.15  # a draft model stops below this probability of its whole draft
VOCAB_MARGIN = 128      # vocabularies may differ in size by this much (padding rows)

# (logits, drafts so far) -> (token, the distribution it was drawn from or None for the argmax,
# the draft's probability of it)
Choose = Callable[[np.ndarray, Sequence[int]], "tuple[int, np.ndarray | None, float]"]


def check_compatible(target_tok, draft_tok, target_cfg, draft_cfg) -> None:
    """A clear error naming the first difference between two models' vocabularies."""
    sizes = (target_cfg.vocab_size, draft_cfg.vocab_size)
    if abs(sizes[0] - sizes[1]) > VOCAB_MARGIN:
        raise TinyrtError(f"the draft model's vocabulary ({sizes[1]} tokens) does not match the "
                          f"target's ({sizes[0]})")
    for name in ("bos_id", "eos_id"):
        a, b = getattr(target_tok, name), getattr(draft_tok, name)
        if a != b:
            raise TinyrtError(f"the draft model's {name[:3].upper()} token is {b}, the target's {a}")
    for i in range(min(target_tok.vocab_size, draft_tok.vocab_size)):
        a, b = target_tok.id_to_token(i), draft_tok.id_to_token(i)
        if a != b:
            raise TinyrtError(f"token {i} is {a!r} in the target's vocabulary but {b!r} in the "
                              "draft model's")


def first_layers(model, n: int):
    """The model's first n decoder layers with its final norm and LM head: a draft that shares
    the target's weights (no memory of its own but its KV cache)."""
    if not 1 <= n < model.config.num_hidden_layers:
        raise TinyrtError(f"a derived draft takes 1 to {model.config.num_hidden_layers - 1} of "
                          f"the model's layers, not {shown(n)}")
    draft = copy.copy(model)
    draft.layers = model.layers[:n]
    draft.config = dataclasses.replace(model.config, num_hidden_layers=n)
    return draft


def shares_cache(target, draft) -> bool:
    """Whether `draft` may read and write the target's KV cache: the same attention layout (KV
    heads, head size, RoPE frequencies, window), no more layers, and the same embedding table
    (64 rows compared): a copy of the target, quantized or cut to its first layers, whose K/V of
    a token are the target's own but for its rounding."""
    a, b = target.config, draft.config
    layers = range(b.num_hidden_layers)
    if (b.num_hidden_layers > a.num_hidden_layers or b.num_key_value_heads != a.num_key_value_heads
            or b.head_dim != a.head_dim
            or [a.window(i) for i in layers] != [b.window(i) for i in layers]
            or not all(np.array_equal(f, g) for f, g in zip(target.layer_freqs, draft.layer_freqs))):
        return False
    rows = np.linspace(0, min(a.vocab_size, b.vocab_size) - 1, 64).astype(np.int64)
    ta, tb = (m.backend.to_numpy(m.backend.embedding(m.embed, rows)) for m in (target, draft))
    return bool(np.allclose(ta, tb, rtol=1e-2, atol=1e-3))


class ModelDrafter:
    """A draft model. With a KV cache of its own (`shared` False) it is kept in step with the
    target's: what it has seen is the target cache's tokens (`pending` the ones it has not run
    yet). With the target's cache (`shared`; see `shares_cache`) it reads the target's K/V of
    every token before its draft: closer to the target's than its own would be (the default
    model's AWQ draft picks the target's token 3-5 % more often), and no prompt to read nor kept
    drafts to catch up on; its drafts' K/V go to the slots the target's pass then overwrites,
    and are rolled back before it. It ends a draft once the product of its tokens'
    probabilities is below `confidence` (0: never)."""

    def __init__(self, model, cache, name: str = "model", confidence: float = DRAFT_CONFIDENCE,
                 shared: bool = False):
        self.model, self.cache, self.name, self.confidence = model, cache, name, confidence
        self.shared = shared
        self.pending: list[int] = []
        self.synced: int | None = None     # the target cache's next_pos the draft agrees with
        self._fed_drafts = 0

    def start(self, prompt: Sequence[int], target_pos: int) -> None:
        """A generation starts: the target cache holds `target_pos` tokens, `prompt` comes next;
        the draft reads it now, with the target's prefill (a shared cache: the target's prefill
        is the draft's). A draft that lost step (the target's cache was reset or rolled back
        elsewhere) starts again from the prompt alone: its proposals are worse, never wrong."""
        if self.shared:
            return
        if self.synced != target_pos:
            self.cache.reset()
            self.pending = []
        self.model.forward(self.pending + list(prompt), self.cache)
        self.pending = []
        self.synced = None

    def propose(self, token: int, gamma: int,
                choose: Choose) -> tuple[list[int], np.ndarray | None]:
        """At most gamma tokens to follow `token` (the target's last, not in its cache yet), and
        the distributions they were drawn from [n, V] (None where `choose` gives none: the
        draft's argmax, one-hot)."""
        if gamma == 0:                         # (the target takes `token` alone)
            if not self.shared:
                self.pending.append(token)
            return [], None
        feed, self.pending = self.pending + [token], []
        drafts, q, sure = [], [], 1.0
        start = self.cache.next_pos
        try:
            for j in range(gamma):
                if j:
                    feed = [drafts[-1]]
                logits = self.model.backend.to_numpy(self.model.forward(feed, self.cache))[-1]
                x, dist, prob = choose(logits, drafts)
                drafts.append(x)
                if dist is not None:
                    q.append(dist)
                sure *= prob
                if sure < self.confidence:
                    break
        finally:
            if self.shared:                    # the target's cache as it was (even on Ctrl-C)
                self.cache.rollback(self.cache.next_pos - start)
        self._fed_drafts = len(drafts) - 1     # the last draft is not run
        return drafts, np.array(q) if q else None

    def commit(self, accepted: Sequence[int]) -> None:
        """The target kept `accepted`, the first drafts of the last proposal."""
        if self.shared:
            return
        k, fed = len(accepted), self._fed_drafts
        if k < fed:
            self.cache.rollback(fed - k)
        self.pending += accepted[fed:]
        self._fed_drafts = 0

    def finish(self, target_pos: int, trim: int) -> None:
        """The generation ended with the target cache at `target_pos`, after it dropped its last
        `trim` tokens: drop them here too."""
        if self.shared:
            return
        drop = min(trim, len(self.pending))
        self.pending = self.pending[:len(self.pending) - drop]
        try:
            self.cache.rollback(trim - drop)
            self.synced = target_pos
        except ValueError:
            self.synced = None

    def lost(self) -> None:
        self.synced = None


class LookupDrafter:
    """Prompt lookup decoding: find the latest earlier occurrence of the last `ngram` tokens of
    the context (then shorter n-grams, down to `min_ngram`) and propose the tokens that followed
    it. The context is the prompt and the reply so far (its last `window` tokens)."""

    name = "lookup"

    def __init__(self, ngram: int = 3, min_ngram: int = 1, window: int = 4096):
        self.ngram, self.min_ngram, self.window = ngram, min_ngram, window
        self.seq = np.zeros(0, np.int64)

    def start(self, prompt: Sequence[int], target_pos: int) -> None:
        self.seq = np.asarray(prompt[-self.window:], dtype=np.int64)

    def propose(self, token: int, gamma: int, choose: Choose) -> tuple[list[int], None]:
        self.seq = np.append(self.seq[1 - self.window:], token)
        seq, n_seq = self.seq, len(self.seq)
        if gamma == 0:
            return [], None
        for n in range(min(self.ngram, n_seq - 1), self.min_ngram - 1, -1):
            # starts i of earlier copies of the last n tokens, with a token after them
            match = np.ones(n_seq - n, bool)
            for o in range(n):
                match &= seq[o:n_seq - n + o] == seq[n_seq - n + o]
            hits = np.flatnonzero(match)
            if hits.size:
                i = hits[-1] + n                     # the latest copy
                return [int(x) for x in seq[i:i + gamma]], None
        return [], None

    def commit(self, accepted: Sequence[int]) -> None:
        if accepted:
            self.seq = np.append(self.seq, accepted)[-self.window:]

    def finish(self, target_pos: int, trim: int) -> None:
        pass

    def lost(self) -> None:
        pass


def make_drafter(spec: str | os.PathLike, target, tokenizer, cache, new_cache, load_model,
                 load_tokenizer):
    """The drafter `--draft spec` names: "lookup", "layers:N" (the target's first N layers) or
    a draft model's directory, for `target` (a decoder), its `tokenizer` and KV `cache`. A
    draft model reads and writes the target's cache where it is a copy of the target (see
    `shares_cache`), else `new_cache(model)`; `load_model(directory, backend)` and
    `load_tokenizer(directory)` load a draft model (passed in: this module loads nothing)."""
    if not cache.can_rollback:        # a draft's rejected tokens must leave the cache
        raise TinyrtError("a draft does not work with --kv-policy h2o (its evictions follow "
                          "the attention of tokens a draft may take back); use dense or sink")
    spec = str(spec)
    if spec == "lookup":
        return LookupDrafter()
    if spec.startswith("layers:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:             # (also an int of too many digits)
            raise TinyrtError(f"--draft {shown(spec)}: N in layers:N is a number of layers") \
                from None
        model, name = first_layers(target, n), spec
    else:
        directory = Path(spec)
        model, name = load_model(directory, target.backend), directory.name
        check_compatible(tokenizer, load_tokenizer(directory), target.config, model.config)
    if shares_cache(target, model):
        return ModelDrafter(model, cache, name, shared=True)
    return ModelDrafter(model, new_cache(model), name)


def accept(p: Sequence[np.ndarray], q: np.ndarray | None, drafts: Sequence[int],
           rng: np.random.Generator) -> tuple[int, int]:
    """Leviathan et al.'s rule, a function of the two models' distributions alone: (how many
    drafts stay, the token that follows them). `p[j]` is the target's distribution [V] after
    the first j drafts, j = 0..n (an array [n + 1, V], or `Rows`: the rule reads p[j] only up
    to the first rejection); `q` [n, V] the draft's, from which `drafts` were drawn (None: a
    deterministic draft, q one-hot); `rng` draws the coin flips and the token."""
    for j, x in enumerate(drafts):
        pj = p[j]
        qx = 1.0 if q is None else q[j, x]
        if pj[x] >= qx or rng.random() * qx < pj[x]:
            continue
        if q is None:
            r = pj.copy()
            r[x] = 0.0
        else:
            r = np.maximum(pj - q[j], 0.0)
        return j, draw(r / r.sum(), rng)
    return len(drafts), draw(p[len(drafts)], rng)


class Rows:
    """p[j] = row(j), computed when read, for `accept`: a row is a sort and filter over the
    whole vocabulary (for the default model's 49152 ids, 1.2 ms with top-k 40 and 6 ms with
    none, against 5-25 ms for its decode step, AWQ or float), and after a rejection the rule
    reads no more of them."""

    def __init__(self, n: int, row: Callable[[int], np.ndarray]):
        self.n, self.row = n, row

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> np.ndarray:
        if not 0 <= j < self.n:
            raise IndexError(j)
        return self.row(j)


@dataclasses.dataclass
class SpecStats:
    """What the drafts did in one reply (in `Timings.speculative`)."""

    drafter: str = ""
    draft_s: float = 0.0          # proposing
    target_s: float = 0.0         # the target's passes over the drafts, and acceptance
    target_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    gamma: int = 0                # the bound of the drafts' length at the end (it may adapt)

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens each target pass produced: the accepted drafts and the one that follows."""
        return (self.accepted + self.target_steps) / self.target_steps if self.target_steps else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["accept_rate"], d["tokens_per_step"] = self.accept_rate, self.tokens_per_step
        return d


class SpeculativeGeneration(Generation):
    """A `Generation` whose decode steps draft and verify, at most `gamma` drafts per step, a
    bound that adapts within [1, max_gamma]: one more after a step that kept every draft, one
    fewer after one that kept less than half."""

    def __init__(self, *args, drafter, gamma: int = 4, max_gamma: int = MAX_GAMMA,
                 adapt: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if not 1 <= gamma <= max_gamma:
            raise TinyrtError(f"draft tokens must be between 1 and {max_gamma}, got {gamma}")
        self.drafter, self.gamma, self.max_gamma, self.adapt = drafter, gamma, max_gamma, adapt
        self.timings.speculative = SpecStats(drafter=drafter.name, gamma=gamma)

    def _token_ids(self) -> Iterator[int]:
        t, s, cache, sampler = self.timings, self.timings.speculative, self.cache, self.sampler
        V = self.model.config.vocab_size
        keep = sampler.history_size
        greedy = sampler.params.temperature == 0
        argmax = greedy and not keep       # each token the plain argmax of its logits
        start = time.perf_counter()
        self.drafter.start(self.prompt, cache.next_pos)
        logits = self._logits(self.prompt)
        t.prefill_s = time.perf_counter() - start
        history = self.prompt[len(self.prompt) - keep:] if keep else []
        out = [sampler(logits, history)]
        t.ttft_s = time.perf_counter() - start
        produced, held = 0, 0      # tokens yielded; of the last `out`, tokens the cache holds
        try:
            while True:
                for i, tok in enumerate(out):
                    if keep:
                        history.append(tok)
                    produced += 1
                    t.decode_steps = produced - 1
                    held = len(out) - 1 - i   # the cache holds out[:-1]; the caller has out[:i+1]
                    yield tok
                held = 0
                if keep and len(history) > 2 * keep:
                    del history[:-keep]
                tok = out[-1]
                gamma = min(self.gamma, self.max_tokens - produced - 1, cache.chunk - 1)
                while gamma > 0 and not cache.fits(gamma + 1):
                    gamma -= 1
                if not cache.fits(1):
                    break
                step = time.perf_counter()

                def choose(logits, drafts):
                    if len(logits) < V:            # a draft vocabulary a few ids smaller
                        logits = np.concatenate([logits, np.full(V - len(logits), -np.inf)])
                    if argmax:      # (the sampler's check, which its argmax skips)
                        check_logits(logits[:V])
                        x, d = int(np.argmax(logits[:V])), None
                    else:
                        d = sampler.distribution(logits[:V], history + drafts if keep else ())
                        x = sampler.draw(d)
                    if greedy:      # the probability under the draft's own softmax (float32:
                        # NumPy's float64 exp takes 7x as long, 0.9 ms a draft token)
                        return x, d, 1.0 / np.exp(logits[:V] - logits[x], dtype=np.float32).sum()
                    return x, d, d[x]

                drafts, q = self.drafter.propose(tok, gamma, choose)
                verify = time.perf_counter()
                rows = self.model.backend.to_numpy(
                    self.model.forward([tok, *drafts], cache, all_logits=True))

                def p_row(j):       # the target's distribution after the first j drafts
                    return sampler.distribution(rows[j], history + drafts[:j] if keep else ())

                if argmax:          # exact match with the target's argmax (Leviathan's rule
                    check_logits(rows)              # for one-hot p and q, without the arrays)
                    best = rows.argmax(axis=1)
                    k = next((j for j, x in enumerate(drafts) if x != best[j]), len(drafts))
                    nxt = int(best[k])
                else:
                    k, nxt = accept(Rows(len(drafts) + 1, p_row), q, drafts, sampler.rng)
                cache.rollback(len(drafts) - k)
                self.drafter.commit(drafts[:k])
                out = [*drafts[:k], nxt]
                end = time.perf_counter()
                t.decode_s += end - step
                s.draft_s += verify - step
                s.target_s += end - verify
                s.target_steps += 1
                s.drafted += len(drafts)
                s.accepted += k
                if self.adapt and drafts:
                    if k == len(drafts):
                        self.gamma = min(self.gamma + 1, self.max_gamma)
                    elif k < len(drafts) // 2:
                        self.gamma = max(1, self.gamma - 1)
                    s.gamma = self.gamma
            self.drafter.finish(cache.next_pos, 0)
        except GeneratorExit:
            # the caller stopped at a token the cache already holds the tokens after: drop them,
            # so the cache holds what came before the last token, as after a plain decode step
            if held:
                cache.rollback(held)
            self.drafter.finish(cache.next_pos, held)
            raise
        except BaseException:
            self.drafter.lost()            # (the caller settles the target's cache)
            raise
