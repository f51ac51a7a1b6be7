"""Bounded soaks: a long generation and a long chat under the sink policy keep their memory flat
once the cache is full (the full-size runs: benchmarks/soak.py, benchmarks/chat_turns.py)."""

import pytest

import tinyrt
from helpers import tiny_config, write_tiny_model
from tinyrt.converters import convert

SLACK_KIB = 2048          # allocator noise; a leak of one logits row (1.25 KiB) per token exceeds it


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("soak") / "m", tiny_config(num_attention_heads=4), seed=3)
    return {"float": d, "4-bit": convert(d, d.parent / "q", method="rtn", group_size=32)}


@pytest.mark.parametrize("kind", ["float", "4-bit"])
def test_long_generation_memory_is_flat(models, kind):
    """6000 sampled tokens through a 64-slot sink cache (about 90 wrap-arounds)."""
    llm = tinyrt.LLM(models[kind], kv_size=64, kv_policy="sink")
    rss = {}
    n = 0
    for r in llm.stream("hello", max_tokens=6000, temperature=1.0, seed=1, ignore_eos=True):
        n += r.token is not None
        if n % 500 == 0:
            rss[n] = rss_kib()
        assert llm.cache.length <= 64
    assert n == 6000 and r.finish_reason == "length"
    after = [v for k, v in rss.items() if k > 1000]
    assert max(after) - rss[1000] < SLACK_KIB, rss


def test_long_chat_memory_is_flat(models):
    """150 turns of a chat through a 128-slot sink cache: no turn fails for length, and memory
    stays flat but for the conversation's own text. (A random model's reply may hold a special
    token, after which the session prefills the conversation whole: through the sink cache.)"""
    llm = tinyrt.LLM(models["4-bit"], kv_size=128, kv_policy="sink")
    chat = tinyrt.ChatSession(llm, temperature=1.0, max_tokens=12)
    rss = []
    for i in range(150):
        reply = "".join(r.text for r in chat.send(f"turn {i}: tell me more"))
        assert llm.cache.length <= 128 and chat.last_finish in ("length", "stop"), i
        rss.append(rss_kib())
    text_kib = sum(len(m["content"]) for m in chat.messages) * 4 / 1024
    assert max(rss[50:]) - rss[49] < SLACK_KIB + text_kib, rss
    assert len(chat.messages) == 300 and reply is not None
