"""Tokenizers: the default model's (from its GGUF), sentencepiece models, and incremental
detokenization."""

import json
import random

import pytest

from helpers import seeded_rng
from tinyrt.tokenizer import Detokenizer, SPTokenizer, load_tokenizer

HARD_STRINGS = [
    "Hello world! 123",
    "  multiple   spaces\tand\ttabs\n\n\nnewlines",
    "Emoji 😀👍🏽🇫🇷 and ZWJ 👩‍👩‍👧",
    "中文字符，日本語のテキスト、한국어",
    "def f(x):\n    return {'a': [x**2 for _ in range(3)]}  # comment\n",
    "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "control \x00\x01\x7f chars \u200b\ufeff",
    "naïve café résumé Ünïcödé",
    "",
]

# llama.cpp's ids for strings where whitespace precedes a digit: the file's `smollm` pre-tokenizer
# splits digits first (as llama.cpp and the original SmolLM2 tokenizer do); transformers, reading the
# GGUF, ignores `tokenizer.ggml.pre` and differs here. Recorded with llama-cpp-python 0.3.36.
LLAMA_CPP_IDS = {
    "日本語 😀 café\n\n 42": [23274, 115, 40993, 179, 120, 248, 40303, 218, 37366, 8866, 36, 34],
    "def f(x):\n    return x**2  # 10\t\t7":
        [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 216, 33, 32, 1656, 39],
    "Total:  1999 items": [17647, 42, 256, 33, 41, 41, 41, 3723],
    "x =\n 3": [104, 446, 3805, 35],
}


@pytest.fixture(scope="module")
def smol_tok(smol):
    return load_tokenizer(smol)


@pytest.fixture(scope="module")
def hf_dir_tok(smol_f32):
    """transformers reading the tokenizer files our converter wrote."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_f32))


@pytest.mark.real_model
def test_default_model_whole_long_text_equals_transformers(smol_tok, hf_dir_tok, long_text):
    ours = smol_tok.encode(long_text)
    assert len(ours) > 300_000
    assert ours == hf_dir_tok(long_text, add_special_tokens=False)["input_ids"]


@pytest.mark.real_model
@pytest.mark.parametrize("text", HARD_STRINGS)
def test_default_model_hard_strings_equal_transformers(smol_tok, hf_dir_tok, hf_gguf_tokenizer, text):
    ours = smol_tok.encode(text)
    assert ours == hf_dir_tok(text, add_special_tokens=False)["input_ids"]
    assert ours == hf_gguf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert smol_tok.decode(ours, skip_special=False) == text


@pytest.mark.real_model
def test_long_text_lines_equal_transformers_gguf_where_it_follows_the_file(smol_tok, hf_gguf_tokenizer,
                                                                          long_text):
    """transformers' GGUF tokenizer agrees line by line wherever no whitespace precedes a digit."""
    import re

    lines = [l for l in long_text.split("\n") if l and not re.search(r"\s\d", l)]
    assert len(lines) > 1000
    batch = hf_gguf_tokenizer(lines, add_special_tokens=False)["input_ids"]
    assert [smol_tok.encode(l) for l in lines] == batch


@pytest.mark.real_model
@pytest.mark.parametrize("text", list(LLAMA_CPP_IDS))
def test_default_model_digits_follow_llama_cpp(smol_tok, text):
    assert smol_tok.encode(text) == LLAMA_CPP_IDS[text]


@pytest.mark.real_model
def test_default_model_special_tokens(smol_tok):
    assert smol_tok.bos_id == 1 and smol_tok.eos_id == 2
    assert smol_tok.encode("<|im_end|>") == [2]
    assert smol_tok.encode("hi", add_special=True) == smol_tok.encode("hi")  # no BOS for this model


# -- sentencepiece ---------------------------------------------------------------------------------

def _train_sentencepiece(d, model_type, text):
    import sentencepiece as spm

    (d / "train.txt").write_text(text)
    spm.SentencePieceTrainer.train(
        input=str(d / "train.txt"), model_prefix=str(d / "tokenizer"), vocab_size=800,
        model_type=model_type, byte_fallback=True, user_defined_symbols=["<tool>"],
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        minloglevel=2)
    return d


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def sp_model(request, tmp_path_factory, long_text):
    return _train_sentencepiece(tmp_path_factory.mktemp(f"sp_{request.param}"), request.param,
                                long_text[:300_000])


def test_sentencepiece_model_equals_sentencepiece(sp_model, long_text):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model / "tokenizer.model"))
    ours = load_tokenizer(sp_model)
    assert isinstance(ours, SPTokenizer)
    for text in [long_text[300_000:400_000]] + HARD_STRINGS:
        text = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        assert ours.encode(text) == sp.encode(text)
        assert ours.encode(text, add_special=True) == [sp.bos_id()] + sp.encode(text)


def test_sentencepiece_special_tokens_are_split_out(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model / "tokenizer.model"))
    ours = load_tokenizer(sp_model)
    text = "<s>Hello</s> there<tool>x <unk>"
    # as llama.cpp: special tokens become their ids, each text piece between them is encoded alone
    want = [1] + sp.encode("Hello") + [2] + sp.encode(" there<tool>x <unk>")
    assert ours.encode(text) == want
    assert ours.decode(want) == sp.decode(want)


def test_spm_gguf_vocab_tokenizes_as_sentencepiece(tmp_path, long_text):
    """A llama-vocab GGUF (tokens, scores, types) becomes a tokenizer.json that matches
    sentencepiece on the BPE model it came from (llama.cpp runs SPM vocabularies by that rule)."""
    import sentencepiece as spm

    from tinyrt.gguf_tokenizer import build_tokenizer

    d = _train_sentencepiece(tmp_path, "bpe", long_text[:300_000])
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i)
             else 4 if sp.id_to_piece(i) == "<tool>" else 1 for i in range(n)]
    meta = {"model": "llama", "tokens": [sp.id_to_piece(i) for i in range(n)],
            "scores": [sp.get_score(i) for i in range(n)], "token_type": types,
            "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}
    tok, add_bos = build_tokenizer(meta)
    assert add_bos
    for text in [long_text[300_000:360_000]] + HARD_STRINGS[:5] + HARD_STRINGS[6:]:
        assert tok.encode(text).ids == [1] + sp.encode(text), text[:50]


# -- incremental detokenization --------------------------------------------------------------------

@pytest.mark.real_model
def test_detokenizer_streams_exactly_the_decoded_text(smol_tok):
    rng = random.Random(int(seeded_rng().integers(1 << 31)))
    texts = HARD_STRINGS[:-1] + ["Ünïcödé 😀😀😀 " * 5]
    for text in texts:
        ids = smol_tok.encode(text)
        d = Detokenizer(smol_tok)
        deltas = [d.add(i) for i in ids] + [d.flush()]
        assert "".join(deltas) == smol_tok.decode(ids)
        assert all("\ufffd" not in x for x in deltas)
    # random token soup: never half a character on screen, and the same text in the end
    for _ in range(20):
        ids = [rng.randrange(17, smol_tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        d = Detokenizer(smol_tok)
        deltas = [d.add(i) for i in ids]
        assert "".join(deltas) + d.flush() == smol_tok.decode(ids)
        full = smol_tok.decode(ids)
        if "\ufffd" not in full:
            assert all("\ufffd" not in x for x in deltas)


def test_detokenizer_sentencepiece_keeps_spaces(sp_model):
    ours = load_tokenizer(sp_model)
    text = "Hello there, friend. 😀 ok"
    ids = ours.encode(text)
    d = Detokenizer(ours)
    assert "".join(d.add(i) for i in ids) + d.flush() == ours.decode(ids) == text


# -- hostile tokenizer files -----------------------------------------------------------------------

def _tokenizer_dir(d, tokenizer=None, config=None):
    """A directory with the tiny byte-level tokenizer; `tokenizer(json)` and `config(dict)` edit
    its tokenizer.json and tokenizer_config.json."""
    from helpers import CHATML, byte_level_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    tok = json.loads(byte_level_tokenizer(320).to_str())
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (d / "tokenizer.json").write_text(json.dumps(tokenizer(tok) if tokenizer else tok))
    (d / "tokenizer_config.json").write_text(json.dumps(config(cfg) if config else cfg))
    return d


def _with_split(pattern):
    def edit(tok):
        tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": False}, tok["pre_tokenizer"]]}
        return tok
    return edit


def _with_normalizer(pattern):
    def edit(tok):
        tok["normalizer"] = {"type": "Replace", "pattern": {"Regex": pattern}, "content": " "}
        return tok
    return edit


CATASTROPHIC = [r"(a+)+$", r"(\w+\s?)*$", r"(x+x+)+y"]


@pytest.mark.parametrize("pattern", CATASTROPHIC)
@pytest.mark.parametrize("where", [_with_split, _with_normalizer])
def test_a_regex_that_backtracks_without_end_is_refused_at_load(tmp_path, pattern, where):
    """Patterns on which tokenizers' Oniguruma panics (or runs for minutes) at the first encode
    are refused as the tokenizer loads, naming tokenizer.json and the pattern; through the CLI,
    one line (no Rust backtrace on stderr)."""
    from helpers import assert_refused, run_tinyrt, write_tiny_model
    from tinyrt.errors import ModelFormatError

    d = _tokenizer_dir(tmp_path / "t", tokenizer=where(pattern))
    with pytest.raises(ModelFormatError, match="tokenizer.json") as e:
        load_tokenizer(d)
    assert repr(pattern) in str(e.value)
    m = write_tiny_model(tmp_path / "m")
    (m / "tokenizer.json").write_text((d / "tokenizer.json").read_text())
    assert_refused(run_tinyrt("generate", "-m", str(m), "hi", "-n", "2"), "tokenizer.json",
                   "backtracks")


@pytest.mark.parametrize("pattern", [r"\d{1,3}(?=(?:\d{3})*\b)", r"\s+(?!\S)|\s+", r"[\r\n]+",
                                     r"(?i:'s|'t|'re)|\p{L}+|\p{N}{1,3}"])
def test_sound_regexes_load_and_split(tmp_path, pattern):
    """Real tokenizers' patterns (Command-R's digit groups among them) pass the check."""
    tok = load_tokenizer(_tokenizer_dir(tmp_path, tokenizer=_with_split(pattern)))
    text = "Total: 1234567 items\n\n  and 'S more"
    assert tok.decode(tok.encode(text)) == text


def test_a_panic_inside_tokenizers_is_one_clear_error(tmp_path, monkeypatch):
    """Should a panic get past the check at load, encoding raises ModelFormatError (pyo3's
    PanicException is a BaseException: no `except Exception` would have caught it)."""
    import tinyrt.tokenizer as tokenizer_module
    from tinyrt.errors import ModelFormatError

    monkeypatch.setattr(tokenizer_module, "check_patterns", lambda tok, where: None)
    tok = load_tokenizer(_tokenizer_dir(tmp_path, tokenizer=_with_split(r"(a+)+$")))
    with pytest.raises(ModelFormatError, match="tokenizer.json.*tokenizers library failed"):
        tok.encode("a" * 40 + "!")


@pytest.mark.parametrize("decoder", [{"²": {"content": "x"}}, {"abc": {"content": "x"}},
                                     {"-1": {"content": "x"}}, {"9" * 5000: {"content": "x"}},
                                     ["<x>"]])
def test_added_tokens_decoder_keys_must_be_token_ids(tmp_path, decoder):
    from tinyrt.errors import ModelFormatError

    def edit(cfg):
        return {**cfg, "added_tokens_decoder": decoder}

    with pytest.raises(ModelFormatError, match="tokenizer_config.json.*added_tokens_decoder") as e:
        load_tokenizer(_tokenizer_dir(tmp_path, config=edit))
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_a_chat_template_that_is_not_utf8_is_refused(tmp_path):
    from helpers import assert_refused, run_tinyrt, write_tiny_model
    from tinyrt.errors import ModelFormatError

    def no_template(cfg):
        return {k: v for k, v in cfg.items() if k != "chat_template"}

    d = _tokenizer_dir(tmp_path / "t", config=no_template)
    (d / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(ModelFormatError, match="chat_template.jinja is not UTF-8"):
        load_tokenizer(d)
    m = write_tiny_model(tmp_path / "m")
    (m / "tokenizer_config.json").write_text((d / "tokenizer_config.json").read_text())
    (m / "chat_template.jinja").write_bytes((d / "chat_template.jinja").read_bytes())
    assert_refused(run_tinyrt("generate", "-m", str(m), "hi", "-n", "2"), "chat_template.jinja",
                   "UTF-8")
