"""Tiny random models and tokenizers for tests (written with the reference `safetensors` writer, so
that our reader is checked against files it did not produce)."""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings

# The seed of the session's random inputs: fresh every run (kernels are checked on new inputs
# each time), printed in pytest's header (conftest); TINYRT_TEST_SEED=N replays a run's inputs.
SESSION_SEED = int(os.environ.get("TINYRT_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)
_made: dict[str, int] = {}          # generators made so far, per name


def seeded_rng(name: str | None = None) -> np.random.Generator:
    """A generator of random inputs, seeded by the session's seed and a stable hash of `name`
    (by default the running test's id) and of how many generators of that name came before:
    a replayed seed gives a test the same inputs whether it runs alone or in the suite. It
    prints its seed, which pytest shows beside a failure."""
    name = name or os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    n = _made[name] = _made.get(name, -1) + 1
    print(f"random inputs {name!r} #{n}: TINYRT_TEST_SEED={SESSION_SEED}")
    return np.random.default_rng([SESSION_SEED, zlib.crc32(name.encode()), n])

# Property tests' settings: TINYRT_FUZZ_EXAMPLES examples a test (60; more for a long campaign),
# fresh ones every run (hypothesis prints a failure's example and how to replay it), and no
# deadline, which would be a timed assertion (tests/test_fuzz.py guards its calls against hangs)
FUZZ_EXAMPLES = int(os.environ.get("TINYRT_FUZZ_EXAMPLES", "60"))
fuzz = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ("The quick brown fox jumps over the lazy dog. 0123456789 Hello, world! "
          "def f(x):\n    return x * 2\n日本語のテキスト 😀 café naïve\n") * 20


def tiny_config(**over) -> dict:
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=320,
               hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
               bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    cfg.update(over)
    return cfg


def random_weights(cfg: dict, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    Q, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or H // Q

    def mat(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(dtype)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(dtype)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(dtype),
         "model.norm.weight": norm(H)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = mat(V, H)
    for i in range(L):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.q_proj.weight": mat(Q * D, H), p + "self_attn.k_proj.weight": mat(G * D, H),
                  p + "self_attn.v_proj.weight": mat(G * D, H), p + "self_attn.o_proj.weight": mat(H, Q * D),
                  p + "mlp.gate_proj.weight": mat(I, H), p + "mlp.up_proj.weight": mat(I, H),
                  p + "mlp.down_proj.weight": mat(H, I)})
        if cfg.get("model_type") == "qwen2":          # its q, k, v have biases
            w.update({p + f"self_attn.{n}_proj.bias": (0.5 * rng.standard_normal(o)).astype(dtype)
                      for n, o in (("q", Q * D), ("k", G * D), ("v", G * D))})
        if cfg.get("model_type") in ("qwen3", "gemma3_text"):    # each head's q and k RMS-normed
            w.update({p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D)})
        if cfg.get("model_type") == "gemma3_text":    # the MLP's input and both outputs normed
            w.update({p + n + ".weight": norm(H) for n in (
                "pre_feedforward_layernorm", "post_feedforward_layernorm")})
        if cfg.get("model_type") == "phi3":           # fused q|k|v and gate|up
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [w.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            w[p + "mlp.gate_up_proj.weight"] = np.concatenate(
                [w.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    return w


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on CORPUS, with ChatML special tokens at ids 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def write_tiny_model(directory: Path, cfg: dict | None = None, seed: int = 0,
                     dtype=np.float32, weights: dict | None = None) -> Path:
    """An HF model directory with random weights and a byte-level BPE tokenizer."""
    from safetensors.numpy import save_file

    cfg = cfg or tiny_config()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = weights if weights is not None else random_weights(cfg, seed, dtype)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(cfg))
    tok = byte_level_tokenizer(cfg["vocab_size"])
    assert tok.get_vocab_size() <= cfg["vocab_size"]
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def hf_model(directory: Path):
    """transformers' own model for a directory, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Frobenius-norm relative error of a against the reference b."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# docs/GPU.md's contract for a pass of several tokens on the CUDA backend: the logits' relative
# error against the float32 reference, by the prompt GEMMs' operands (kernels/cuda/prompt.py)
PROMPT_ERR = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 3e-3}


def assert_logits_close(got: np.ndarray, want: np.ndarray, err: float) -> None:
    """Logits [T, V] within relative error err of the reference's, and each row's greedy token
    the reference's, but where the reference's top two are nearer than twice the row's largest
    error (a tie that an error within the contract may decide either way)."""
    assert rel_err(got, want) < err, rel_err(got, want)
    for g, w in zip(np.atleast_2d(got), np.atleast_2d(want)):
        if g.argmax() != w.argmax():
            top = np.sort(w)[-2:]
            assert top[1] - top[0] <= 2 * np.abs(g - w).max(), (top, np.abs(g - w).max())


def status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status ("VmRSS", "RssFile", "VmSize"), KiB."""
    with open("/proc/self/status") as f:
        return int(f.read().split(field + ":")[1].split()[0])


def random_quant(out: int, n_in: int, bits: int = 4, g: int = 32, half: bool = True,
                 rng: np.random.Generator | None = None, form: str = "offset"):
    """A random kernels.quant.QuantWeight: codes of `bits` bits in groups of g, scales float16
    values (half) or float32 values that no float16 holds, and a form of kernels.quant's:
    "offset" (a float offset per group), "zero" (symmetric, m = -zero s), "k" (a float per
    block of 4 groups times int8 sub-scales, for the scale and for the offset: the K-quants'),
    "zero-k" (sub-scales and a zero: Q6_K's) or "awq" (offset -s times an integer zero point)."""
    from tinyrt.kernels import quant

    rng = rng or np.random.default_rng(0)
    codes = rng.integers(0, 2 ** bits, (out, n_in)).astype(np.uint8)
    k = 4 if form in ("k", "zero-k") and (n_in // g) % 4 == 0 else 1
    scale = (rng.random((out, n_in // g // k)) * 0.02 + 0.001) * (16 / 2 ** bits)
    dtype = np.float16 if half else np.float32
    scale = scale.astype(dtype).astype(np.float32)
    if not half:
        scale[0, 0] = np.float32(0.001) + np.float32(2 ** -30)          # not a float16
    sub = (lambda lo, hi: rng.integers(lo, hi, (out, n_in // g))) if k > 1 else (lambda *_: None)
    zero = 2 ** (bits - 1)
    if form in ("zero", "zero-k"):
        w = quant.make(codes, bits, scale, scale_q=sub(-40, 40), zero=zero)
    elif form == "awq":
        w = quant.make(codes, bits, scale, -scale, offset_q=rng.integers(0, 2 ** bits, scale.shape))
    else:
        offset = (-scale * rng.uniform(0, 2 ** bits, scale.shape)).astype(dtype).astype(np.float32)
        w = quant.make(codes, bits, scale, offset, scale_q=sub(1, 64), offset_q=sub(0, 64))
    assert w.scale.dtype == dtype
    return w


def quant_store(rows, slots, D, bits, block, residual=0, pin=0, zeros=np.zeros):
    """An empty KIVI store (kernels.kv_quant) of `rows` rows and `slots` slots, its pool sized
    for `residual` tokens and `pin` pinned blocks; `zeros` makes its arrays (a backend's)."""
    from tinyrt.kernels import kv_quant

    return kv_quant.allocate((rows,), slots, D, bits, block,
                             kv_quant.pool_entries(block, residual, pin), pin, zeros)


# -- hostile input: the bar every refusal meets -------------------------------------------------

HOSTILE_SECONDS = 60          # a hang detector, not a speed check (the bar is 10 s on a quiet machine)
HOSTILE_BYTES = 1 << 30       # peak resident memory a refusal may reach


# The child's peak RSS comes from a small launcher between us and it. Linux records, as a process's
# peak (ru_maxrss), the peak of the memory it leaves at exec too: a child vforked from a large
# test process (one that has loaded real models) would report that process's peak. The launcher
# is exec'd once, into a fresh small image, and its own child's peak is tinyrt's alone.
_LAUNCHER = """
import os, resource, subprocess, sys
code = subprocess.run([sys.executable, "-m", "tinyrt", *sys.argv[2:]]).returncode
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(code if code >= 0 else 128 - code)
"""


def run_tinyrt(*args, input: bytes | str | None = None, env: dict | None = None,
               cwd=None, timeout: float = HOSTILE_SECONDS):
    """`python -m tinyrt ARGS` in a subprocess (no stdin unless `input`): its CompletedProcess
    (text decoded with errors replaced) with `peak_bytes`, the child's own peak RSS, and
    `seconds`. A run past `timeout` is killed and fails the calling test as a hang."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    if isinstance(input, str):
        input = input.encode()
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = os.path.join(tmp, "peak")
        start = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", _LAUNCHER, peak_file,
                              *map(os.fsencode, args)],
                             stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)          # the launcher and tinyrt under it
            p.communicate()
            raise AssertionError(f"tinyrt {' '.join(map(str, args))} hung (killed after "
                                 f"{timeout} s)") from None
        seconds = time.monotonic() - start
        with open(peak_file) as f:
            peak = int(f.read())
    result = subprocess.CompletedProcess(p.args, p.returncode, out.decode(errors="replace"),
                                         err.decode(errors="replace"))
    result.peak_bytes, result.seconds = peak, seconds
    if os.environ.get("TINYRT_RUN_LOG"):        # benchmarks/hostile.py: every run's figures
        import json

        with open(os.environ["TINYRT_RUN_LOG"], "a") as log:
            log.write(json.dumps({"args": [os.fsdecode(a)[:80] for a in args],
                                  "returncode": p.returncode, "seconds": seconds,
                                  "peak_bytes": peak, "stderr": result.stderr[-300:]}) + "\n")
    return result


def assert_refused(p, *words: str) -> str:
    """The bar for bad input: exit code != 0, one line on stderr ("tinyrt: error: ...") naming
    each of `words` (case-insensitive), no traceback, under HOSTILE_BYTES of memory. Returns the
    line."""
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode not in (0, None) and p.returncode > 0, (p.returncode, p.stderr)
    # a cold kernel cache (this file's tests run alone on a fresh machine) says why it waits first
    lines = [line for line in p.stderr.splitlines()
             if line.strip() and not line.startswith("note: compiling kernels, once")]
    assert len(lines) == 1 and lines[0].startswith("tinyrt: error:"), p.stderr
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])
    assert p.peak_bytes < HOSTILE_BYTES, f"peak RSS {p.peak_bytes / 2**20:.0f} MiB: {lines[0]}"
    return lines[0]


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


def fit_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square test that counts [G, C] were drawn from the expected counts [G, C]: G groups
    (say, by the token before), each one multinomial (its smallest cells pooled until their
    expected count reaches 5). A group whose expected counts sum draws of different
    distributions (one per trial) varies less than a multinomial: the test is then
    conservative. A token whose expected count is 0 must never come."""
    counts, expected = np.atleast_2d(counts), np.atleast_2d(expected)
    assert counts[expected == 0].sum() == 0, "a token the target never draws"
    stat, df = 0.0, 0
    for o, e in zip(counts, expected):
        order = np.argsort(e)
        small = np.cumsum(np.append(0, e[order][:-1])) < 5       # the pool reaches 5
        o = np.append(o[order][~small], o[order][small].sum())
        e = np.append(e[order][~small], e[order][small].sum())
        live = e > 0
        stat += ((o[live] - e[live]) ** 2 / e[live]).sum()
        df += max(live.sum() - 1, 0)
    return chi2_sf(stat, df) if df else 1.0
