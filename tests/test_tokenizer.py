"""Tokenizers: the default model's (from its GGUF), sentencepiece models, and incremental
detokenization."""

import json
import random

import numpy as np
import pytest

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


def test_default_model_whole_long_text_equals_transformers(smol_tok, hf_dir_tok, long_text):
    ours = smol_tok.encode(long_text)
    assert len(ours) > 300_000
    assert ours == hf_dir_tok(long_text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_default_model_hard_strings_equal_transformers(smol_tok, hf_dir_tok, hf_gguf_tokenizer, text):
    ours = smol_tok.encode(text)
    assert ours == hf_dir_tok(text, add_special_tokens=False)["input_ids"]
    assert ours == hf_gguf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert smol_tok.decode(ours, skip_special=False) == text


def test_long_text_lines_equal_transformers_gguf_where_it_follows_the_file(smol_tok, hf_gguf_tokenizer,
                                                                          long_text):
    """transformers' GGUF tokenizer agrees line by line wherever no whitespace precedes a digit."""
    import re

    lines = [l for l in long_text.split("\n") if l and not re.search(r"\s\d", l)]
    assert len(lines) > 1000
    batch = hf_gguf_tokenizer(lines, add_special_tokens=False)["input_ids"]
    assert [smol_tok.encode(l) for l in lines] == batch


@pytest.mark.parametrize("text", list(LLAMA_CPP_IDS))
def test_default_model_digits_follow_llama_cpp(smol_tok, text):
    assert smol_tok.encode(text) == LLAMA_CPP_IDS[text]


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

def test_detokenizer_streams_exactly_the_decoded_text(smol_tok):
    rng = random.Random()
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
