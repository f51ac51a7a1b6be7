"""What reaches the user's terminal from a model or a file: control characters (escape
sequences that retitle, clear or recolour it) shown as visible escapes, everywhere tinyrt writes
such text; `--raw-output` writes a reply as generated."""

import io
import json

import pytest

from helpers import random_weights, run_tinyrt, tiny_config, write_tiny_model

GREEDY = ("-n", "12", "--temperature", "0", "--ignore-eos")


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    """A model that writes nothing but ESC and "]" (OSC, which sets a terminal's title): every
    logit is zero but those two tokens', of opposite signs on one dimension of the final norm."""
    from tokenizers import Tokenizer

    directory = tmp_path_factory.mktemp("hostile")
    cfg = tiny_config()
    write_tiny_model(directory, cfg)           # (its tokenizer, to find the two tokens)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    (esc,), (osc,) = tok.encode("\x1b").ids, tok.encode("]").ids
    w = random_weights(cfg)
    w["model.norm.weight"][:] = 0
    w["model.norm.weight"][0] = 1
    w["lm_head.weight"][:] = 0
    w["lm_head.weight"][esc, 0], w["lm_head.weight"][osc, 0] = 50, -50
    return write_tiny_model(directory, cfg, weights=w)


def _escaped(text: str) -> None:
    assert "\\x1b" in text, text
    assert "\x1b" not in text, text


def test_a_reply_s_escape_sequences_are_shown_not_obeyed(hostile_model):
    for command in ("generate", "run"):
        p = run_tinyrt(command, str(hostile_model), "hi", *GREEDY)
        assert p.returncode == 0, p.stderr
        _escaped(p.stdout)
    p = run_tinyrt("generate", str(hostile_model), "hi", *GREEDY, "--json")
    assert "\x1b" in json.loads(p.stdout)["text"]          # (JSON escapes it: \u001b)
    p = run_tinyrt("generate", str(hostile_model), "hi", *GREEDY, "--raw-output")
    assert p.returncode == 0 and "\x1b" in p.stdout, p.stderr
    for command in ("chat", "run"):                          # piped: one turn a line
        p = run_tinyrt(command, str(hostile_model), *GREEDY, input="hi\nagain\n")
        assert p.returncode == 0 and p.stdout.count("\n") == 2, p.stderr
        _escaped(p.stdout)
        p = run_tinyrt(command, str(hostile_model), *GREEDY, "--raw-output", input="hi\n")
        assert "\x1b" in p.stdout


def test_a_draft_model_s_name_is_shown_safe(hostile_model, tmp_path):
    """--draft's folder name in --stats' line and bench's figures."""
    import shutil

    draft = tmp_path / "d\x1b]0;pwned\x07"
    shutil.copytree(hostile_model, draft)
    p = run_tinyrt("generate", str(hostile_model), "hi", *GREEDY, "--draft", str(draft),
                   "--stats")
    assert p.returncode == 0 and "draft d\\x1b]0;pwned\\x07" in p.stderr, p.stderr
    assert "\x1b" not in p.stderr
    p = run_tinyrt("bench", str(hostile_model), "--draft", str(draft), "--prompt-tokens", "8",
                   "--decode-tokens", "8", "--runs", "1")
    assert p.returncode == 0 and "d\\x1b]0;pwned\\x07" in p.stdout, p.stderr
    assert "\x1b" not in p.stdout


@pytest.mark.parametrize("markdown", [True, False])
def test_the_chat_s_rendering_shows_them_too(hostile_model, markdown):
    """In a terminal the reply is drawn by rich (which passes ESC through) and the notes too:
    neither writes the model's ESC (rich writes its own, for colours and the live region: each
    a CSI, ESC [, where the model's are followed by ESC or "]")."""
    import re

    from rich.console import Console

    import tinyrt
    from tinyrt.cli.chat import Printer, reply

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=60)
    session = tinyrt.ChatSession(tinyrt.load(hostile_model), temperature=0, max_tokens=12,
                                 ignore_eos=True)
    out = Printer(console, markdown=markdown, notes=console, interval=0)
    reply(session, "hi", out, None)
    out.note(session.messages[-1]["content"])
    assert not re.search("\x1b[^[]", screen.getvalue()) and "\\x1b" in screen.getvalue()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tinyrt import model_cache

    gguf = model_cache.gguf_dir()
    gguf.mkdir(parents=True)
    return gguf


def test_list_and_rm_show_a_record_s_and_a_name_s_escapes(cache):
    """A cache record's `source` and a cached file's name are a file's text."""
    from tinyrt import model_cache

    evil = cache / "title\x1b]0;pwned\x07.gguf"
    evil.write_bytes(b"GGUF" + bytes(100))
    model_cache._write_record(evil, "0" * 64, "pip \x1b[2J\x1b[31mred", wrote=True)
    fetch = cache / ".fetch-\x1b[2Jx"
    fetch.mkdir()
    model_cache.mark_fetch(fetch, ["part"], []).close()
    p = run_tinyrt("list")
    assert p.returncode == 0 and "title\\x1b]0;pwned\\x07.gguf" in p.stdout, p.stderr
    assert "pip \\x1b[2J\\x1b[31mred" in p.stdout and "\x1b" not in p.stdout
    p = run_tinyrt("rm", "--all", "-y")
    assert p.returncode == 0 and p.stdout.count("removed") == 2, p.stderr
    assert "\x1b" not in p.stdout + p.stderr and "\\x1b[2J" in p.stdout
    assert not evil.exists() and not fetch.exists()


def test_info_and_error_lines_show_a_path_s_escapes(tmp_path):
    """A model directory (or a file) named with escape sequences, described or refused; an
    undecodable name (surrogate-escaped bytes) shown with U+FFFD, not a UnicodeEncodeError."""
    import os

    named = write_tiny_model(tmp_path / "m\x1b]0;pwned\x07")
    p = run_tinyrt("info", str(named))
    assert p.returncode == 0 and "m\\x1b]0;pwned\\x07" in p.stdout, p.stderr
    assert "\x1b" not in p.stdout
    for arg in ("nowhere\x1b[2J", os.fsdecode(b"nowhere\xff\x1b[2J")):
        p = run_tinyrt("generate", arg, "hi")
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert "\x1b" not in p.stderr and "\\x1b[2J" in p.stderr
    p = run_tinyrt("generate", "--temprature\x1b[2J", "0", "hi")      # argparse's error line
    assert p.returncode == 2 and "\x1b" not in p.stderr and "\\x1b[2J" in p.stderr, p.stderr
