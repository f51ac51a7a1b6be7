"""`tinyrt bench`'s figures on a tiny model: what it counts per decoded token."""

import pytest

import tinyrt
from helpers import assert_refused, run_tinyrt, tiny_config, write_tiny_model
from tinyrt import bench
from tinyrt.converters import convert


@pytest.mark.parametrize("kv_type, itemsize", [("f16", 2), ("f32", 4)])
def test_bench_counts_weights_and_kv_cache(tmp_path, kv_type, itemsize):
    cfg = tiny_config()
    llm = tinyrt.LLM(write_tiny_model(tmp_path / "m", cfg), kv_size=32, kv_type=kv_type)
    r = bench.run(llm, prompt_tokens=16, decode_tokens=4, runs=1)
    c = llm.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * itemsize * (16 + 4 / 2)
    assert r["kv_mb_per_token"] == pytest.approx(kv / 1e6)
    assert r["weight_mb_per_token"] == pytest.approx(bench.weight_bytes(llm.model) / 1e6)
    step = 1 / r["decode_tok_s"]
    assert r["decode_gb_s"] == pytest.approx((r["weight_mb_per_token"] + r["kv_mb_per_token"]) / 1e3 / step)
    assert r["ttft_s"] > 0 and r["prefill_tok_s"] == pytest.approx(16 / r["ttft_s"])
    with pytest.raises(ValueError, match="exceed the KV cache"):
        bench.run(llm, prompt_tokens=30, decode_tokens=4, runs=1)


def test_bench_of_a_4bit_model(tmp_path):
    """A 4-bit model's layers read their packed codes, scales and offsets (about a sixth of
    float32's bytes at group 32) and its tied LM head int8 rows with their scales."""
    cfg = tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=4, tie_word_embeddings=True)
    d = write_tiny_model(tmp_path / "m", cfg)
    q, f = (tinyrt.LLM(m, kv_size=32) for m in (convert(d, tmp_path / "q", method="rtn", group_size=32), d))
    r = bench.run(q, prompt_tokens=8, decode_tokens=2, runs=1)
    assert r["weight_mb_per_token"] == pytest.approx(bench.weight_bytes(q.model) / 1e6)
    names = ("qkv", "o", "gate_up", "down")
    packed = sum(getattr(L, n).nbytes for L in q.model.layers for n in names)
    floats = sum(getattr(L, n).nbytes for L in f.model.layers for n in names)
    assert 0.1 < packed / floats < 0.2
    norms = sum(L.input_norm.nbytes + L.post_norm.nbytes for L in q.model.layers) + q.model.norm.nbytes
    head = q.model.lm_head
    assert bench.weight_bytes(q.model) == packed + norms + head.q.nbytes + head.s.nbytes


def test_bench_counts_the_cuda_backend_s_tensors(tmp_path):
    """On the CUDA backend (Numba's simulator here) the weights are torch tensors: float layers
    and head as float16, half the bytes of the CPU's float32, the norms alike."""
    cfg = tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_hidden_layers=1)
    d = write_tiny_model(tmp_path / "m", cfg)
    cpu, gpu = (tinyrt.LLM(d, device=dev, dtype="f32").model for dev in ("cpu", "cuda"))
    names = ("qkv", "o", "gate_up", "down")
    floats = sum(getattr(L, n).nbytes for L in cpu.layers for n in names) + cpu.lm_head.nbytes
    assert bench.weight_bytes(gpu) == bench.weight_bytes(cpu) - floats // 2 > 0


@pytest.mark.parametrize("args, flag", [
    (["--decode-tokens", "0"], "--decode-tokens"), (["--prompt-tokens", "-1"], "--prompt-tokens"),
    (["--prompt-tokens", "1e12"], "--prompt-tokens"), (["--runs", "0"], "--runs"),
    (["--runs", "two"], "--runs"), (["--decode-tokens", "2.5"], "--decode-tokens"),
    (["--prompt-tokens", str(bench.MAX_TOKENS + 1)], "--prompt-tokens"),
    # llama-bench's names
    (["-p", "0"], "--prompt-tokens"), (["--n-gen", "x"], "--decode-tokens"),
    (["-r", "0"], "--runs"),
])
def test_bad_sizes_are_refused_before_loading(tmp_path, args, flag):
    """(The model does not exist: the option is refused first, before a cache of the sizes'
    sum is allocated; the model named as with every command, as the first argument or -m.)"""
    assert_refused(run_tinyrt("bench", str(tmp_path / "no-model"), *args), flag)
    assert_refused(run_tinyrt("bench", "-m", str(tmp_path / "no-model"), *args), flag)


def test_bench_decodes_greedily_without_a_penalty_whatever_the_model_asks(tmp_path):
    """Its runs time the plain decode step, the same tokens each run, though the model's
    generation_config.json asks for sampling with a repeat penalty; its warm-up is a short
    reply of the same settings (on a GPU the runs then replay the step it captured)."""
    import json

    d = write_tiny_model(tmp_path / "m", tiny_config())
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.9,
                                                          "repetition_penalty": 1.3}))
    llm = tinyrt.LLM(d, kv_size=32)
    assert llm.sampling_defaults() == {"temperature": 0.9, "repeat_penalty": 1.3}
    runs, generation = [], llm.generation

    def recorded(*a, **k):
        g = generation(*a, **k)
        runs.append(g)
        return g

    llm.generation = recorded
    r = bench.run(llm, prompt_tokens=8, decode_tokens=6, runs=3)
    params = {g.sampler.params for g in runs}
    assert len(runs) == 4 and len(params) == 1
    p = params.pop()
    assert p.temperature == 0 and p.repeat_penalty == 1.0
    warm, timed = runs[0], runs[1:]
    assert len(warm.tokens) == bench.WARM_TOKENS < len(timed[0].tokens) == 7
    assert len({tuple(g.tokens) for g in timed}) == 1
    assert r["first_reply_extra_s"] >= 0


def test_bench_run_refuses_what_it_cannot_measure(tmp_path):
    from tinyrt.errors import TinyrtError

    llm = tinyrt.LLM(write_tiny_model(tmp_path / "m", tiny_config()), kv_size=32)
    for bad in (dict(decode_tokens=0), dict(prompt_tokens=0), dict(runs=0), dict(runs=True)):
        with pytest.raises(TinyrtError, match=next(iter(bad))):
            bench.run(llm, **{"prompt_tokens": 8, "decode_tokens": 2, "runs": 1, **bad})
    r = bench.run(llm, prompt_tokens=8, decode_tokens=1, runs=1)     # one token: one step
    assert r["decode_tok_s"] > 0


def test_sizes_past_the_models_context_are_refused(tmp_path):
    """A prompt and decode longer than the model's context: refused in one line (as ppl's --ctx),
    not run for minutes over positions the model never had."""
    d = write_tiny_model(tmp_path / "m", tiny_config())
    context = tinyrt.LLM(d, kv_size=32).config.max_position_embeddings
    assert_refused(run_tinyrt("bench", str(d), "--prompt-tokens", str(context),
                              "--decode-tokens", "1", "--runs", "1"), "context")


def test_bench_run_says_each_phase_and_run_as_it_starts(tmp_path):
    """progress(what, done, total): the warm-up, then each run before and after it; never for a
    run that is refused."""
    llm = tinyrt.LLM(write_tiny_model(tmp_path / "m", tiny_config()), kv_size=32)
    calls = []
    bench.run(llm, prompt_tokens=8, decode_tokens=2, runs=3,
              progress=lambda *a: calls.append(a))
    runs = "3 runs, prompt 8 + decode 2 tokens"
    assert calls == [("warm-up", 0, None)] + [(runs, k, 3) for k in range(4)]
    calls.clear()
    with pytest.raises(ValueError):
        bench.run(llm, prompt_tokens=30, decode_tokens=4, runs=1,
                  progress=lambda *a: calls.append(a))
    assert calls == []


def test_the_command_shows_progress_on_stderr_and_keeps_stdout_clean(tmp_path):
    """Piped: a plain line per phase on stderr, stdout the JSON alone. In a terminal (stderr a
    pty, stdout still piped): the phase and run k of n drawn on the terminal, stdout alike."""
    import json
    import os
    import pty
    import select
    import subprocess
    import sys

    d = write_tiny_model(tmp_path / "m", tiny_config())
    args = ("bench", str(d), "-p", "8", "-n", "2", "-r", "3", "--json")
    p = run_tinyrt(*args)
    assert p.returncode == 0 and set(json.loads(p.stdout)) >= {"decode_tok_s"}, p.stderr
    assert p.stderr.splitlines() == ["bench: warm-up", "bench: 3 runs, prompt 8 + decode 2 tokens"]

    main, tty = pty.openpty()
    with open(tmp_path / "stdout", "wb") as stdout:   # (a file: the child never waits on it)
        child = subprocess.Popen([sys.executable, "-m", "tinyrt", *args], stdout=stdout,
                                 stderr=tty, stdin=subprocess.DEVNULL)
    os.close(tty)
    drawn, hung = b"", False
    try:
        while True:
            if not select.select([main], [], [], 300)[0]:
                hung = True                  # (nothing for 300 s)
                break
            chunk = os.read(main, 1 << 16)
            if not chunk:
                break
            drawn += chunk
    except OSError:                          # the child closed the terminal: it is ending
        pass
    finally:
        os.close(main)
        if hung:
            child.kill()
    out = (tmp_path / "stdout").read_bytes()
    assert not hung and child.wait(timeout=60) == 0, drawn
    assert set(json.loads(out)) >= {"decode_tok_s"}, out
    assert b"bench: 3 runs, prompt 8 + decode 2 tokens: 3 of 3" in drawn, drawn
