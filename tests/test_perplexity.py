import json
import math
import subprocess
import sys

import pytest

from helpers import CORPUS, hf_model, tiny_config, write_tiny_model
from tinyrt.errors import TinyrtError
from tinyrt.kv_options import CacheOptions
from tinyrt.perplexity import perplexity


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import tinyrt

    d = write_tiny_model(tmp_path_factory.mktemp("ppl") / "m", tiny_config(), seed=2)
    return d, tinyrt.LLM(d, kv_type="f32")            # float32 KV: the protocol checked exactly


def test_perplexity_matches_transformers(tiny):
    import torch

    d, llm = tiny
    ctx = 100
    result = perplexity(llm, CORPUS, ctx=ctx, max_windows=3)
    ids = llm.tokenizer.encode(CORPUS, add_special=True)
    model = hf_model(d)
    nll = 0.0
    with torch.no_grad():
        for w in range(3):
            x = torch.tensor([ids[w * ctx:(w + 1) * ctx]])
            logits = model(x).logits[0, :-1].double()
            nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
    assert result.windows == 3 and result.tokens == 3 * (ctx - 1)
    assert result.ppl == pytest.approx(math.exp(nll / result.tokens), rel=1e-5)


def test_perplexity_windows_and_errors(tiny):
    _, llm = tiny
    n = len(llm.tokenizer.encode(CORPUS, add_special=True))
    assert perplexity(llm, CORPUS, ctx=64).windows == n // 64
    with pytest.raises(TinyrtError, match="exceeds the model's context"):
        perplexity(llm, CORPUS, ctx=4096)
    with pytest.raises(TinyrtError, match="fewer than one window"):
        perplexity(llm, "hi", ctx=64)


def test_ppl_command_json(tiny, tmp_path):
    d, _ = tiny
    text = tmp_path / "t.txt"
    text.write_text(CORPUS)
    p = subprocess.run([sys.executable, "-m", "tinyrt", "ppl", "-m", str(d), "--text", str(text),
                        "--ctx", "128", "--max-windows", "2", "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"ppl", "tokens", "windows"} and out["windows"] == 2 and out["ppl"] > 1


def test_streaming_perplexity(tiny, tmp_path):
    """Token by token through a dense cache = the windowed protocol over one window of the same
    tokens; sink and h2o caches larger than the text evict nothing and agree; small ones
    differ; the CLI prints the same keys as ppl."""
    from tinyrt.perplexity import stream_perplexity

    d, llm = tiny
    n = 150
    dense = stream_perplexity(llm, CORPUS, CacheOptions("dense", n), max_tokens=n)
    assert dense.tokens == n - 1 and len(dense.nll) == n - 1
    assert dense.ppl == pytest.approx(perplexity(llm, CORPUS, ctx=n, max_windows=1).ppl, rel=1e-5)
    assert dense.ppl_of(0, n - 1) == pytest.approx(dense.ppl)
    for policy in ("sink", "h2o"):
        big = stream_perplexity(llm, CORPUS, CacheOptions(policy, n + 10), max_tokens=n)
        assert big.ppl == pytest.approx(dense.ppl, rel=1e-6)
        small = stream_perplexity(llm, CORPUS, CacheOptions(policy, 24, sinks=4), max_tokens=n)
        assert small.ppl != pytest.approx(dense.ppl, rel=1e-3)
    with pytest.raises(TinyrtError, match="cannot hold"):
        stream_perplexity(llm, CORPUS, CacheOptions("dense", 20), max_tokens=n)
    text = tmp_path / "t.txt"
    text.write_text(CORPUS)
    p = subprocess.run([sys.executable, "-m", "tinyrt", "ppl", "-m", str(d), "--text", str(text),
                        "--stream", "--kv-policy", "h2o", "--kv-size", "32", "--sinks", "2",
                        "--recent", "6",
                        "--max-tokens", "80", "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"ppl", "tokens", "windows"} and out["tokens"] == 79 and out["ppl"] > 1


@pytest.mark.parametrize("args, flag", [(["--max-windows", "-1"], "--max-windows"),
                                        (["--max-windows", "0"], "--max-windows"),
                                        (["--ctx", "1"], "--ctx"), (["--ctx", "-5"], "--ctx"),
                                        (["--stream", "--max-tokens", "-3"], "--max-tokens")])
def test_ppl_numeric_options_are_checked_before_the_model_loads(tmp_path, args, flag):
    """`--max-windows -1` once printed "ppl 1.0000 over -63 tokens"; each such option is refused
    by name, before the model loads (here there is none to load)."""
    from helpers import assert_refused, run_tinyrt

    text = tmp_path / "t.txt"
    text.write_text(CORPUS)
    p = run_tinyrt("ppl", "-m", str(tmp_path / "no-model"), "--text", str(text), *args)
    assert_refused(p, flag)


def test_perplexity_refuses_counts_that_measure_nothing(tiny):
    from tinyrt.perplexity import stream_perplexity

    _, llm = tiny
    with pytest.raises(TinyrtError, match="--max-windows"):
        perplexity(llm, CORPUS, ctx=64, max_windows=-1)
    with pytest.raises(TinyrtError, match="--max-tokens"):
        stream_perplexity(llm, CORPUS, CacheOptions("dense", 64), max_tokens=-3)


def test_ppl_text_that_is_not_utf8_or_missing_is_refused(tiny, tmp_path):
    from helpers import assert_refused, run_tinyrt

    d, _ = tiny
    (tmp_path / "latin1.txt").write_bytes("café ".encode("latin-1") * 100)
    assert_refused(run_tinyrt("ppl", "-m", str(d), "--text", str(tmp_path / "latin1.txt")),
                   "--text", "UTF-8")
    assert_refused(run_tinyrt("ppl", "-m", str(d), "--text", str(tmp_path / "none.txt")),
                   "--text", "no such file")
