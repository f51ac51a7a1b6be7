"""tinyrt's GGUF tokenizer against llama.cpp's own test vectors: each vocabulary-only GGUF of a
family tinyrt runs (`ggml-vocab-NAME.gguf`, as llama.cpp's converter wrote it) gives, on every
string of its `.inp` file, the ids llama.cpp gives (its `.out` file; no BOS); and Gemma's kind of
SentencePiece vocabulary, which llama.cpp ships none of, against SentencePiece itself."""

import pytest

from llama_cpp_files import vocab_vectors
from tinyrt.gguf_tokenizer import gguf_tokenizer
from tinyrt.models.gguf import GGUFFile

# llama.cpp's vocabulary name -> what it stands for
VOCABS = {
    "llama-spm": "Llama 1/2 and Mistral's SentencePiece",
    "llama-bpe": "Llama 3's byte-level BPE (whole pre-tokens in the vocabulary not merged)",
    "qwen2": "Qwen2 and Qwen3's byte-level BPE",
    "phi-3": "Phi-3's SentencePiece",
}


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vocab_vectors(name):
    path, cases = vocab_vectors(name)
    tok, _ = gguf_tokenizer(GGUFFile(path))
    wrong = [(text, want, got) for text, want in cases
             if (got := tok.encode(text, add_special_tokens=False).ids) != want]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ from llama.cpp, first: {wrong[0]}"


def test_gemma_sentencepiece_vocabulary_as_gguf_stores_it(tmp_path):
    """Gemma's kind of SentencePiece vocabulary (BPE with byte fallback, no dummy prefix, digits
    split, user-defined pieces for newlines and tabs, the turn markers special), trained here
    on a small corpus (llama.cpp ships no Gemma 3 vocabulary), written into a Gemma 3 GGUF by
    llama.cpp's own converter: tinyrt's tokenizer of that file gives SentencePiece's own ids on
    llama.cpp's test strings and on a chat turn."""
    import io
    import json

    import sentencepiece as spm

    from helpers import CORPUS
    from llama_cpp_files import convert_with_llama_cpp
    from test_families import write_hf_model

    model = io.BytesIO()
    turns = ["<start_of_turn>", "<end_of_turn>"]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split("\n") * 3), model_writer=model, model_type="bpe",
        vocab_size=400, byte_fallback=True, add_dummy_prefix=False, split_digits=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity",
        user_defined_symbols=[*turns, "\n", "\n\n", "\t"], pad_id=0, eos_id=1, bos_id=2,
        unk_id=3, allow_whitespace_only_pieces=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    d = write_hf_model(tmp_path / "hf", "gemma3_text", True, seed=0, vocab_size=400,
                       num_hidden_layers=6, query_pre_attn_scalar=32,
                       layer_types=["sliding_attention"] * 5 + ["full_attention"])
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.model").write_bytes(model.getvalue())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "added_tokens_decoder": {
            str(sp.piece_to_id(t)): {"content": t, "special": True} for t in turns}}))
    path = convert_with_llama_cpp(d, tmp_path / "gemma.gguf", "f32", pre="default")
    tok, _ = gguf_tokenizer(GGUFFile(path))
    texts = [t for t, _ in vocab_vectors("llama-spm")[1]] + [
        "<start_of_turn>user\nHi  there\n\n\n<end_of_turn>\n<start_of_turn>model\n",
        "a\tb\t\tc 2024-11-28 x\u00b2", "  leading and trailing  "]
    wrong = [(t, want, got) for t in texts
             if (got := tok.encode(t, add_special_tokens=False).ids) != (want := sp.encode(t))]
    assert not wrong, f"{len(wrong)} of {len(texts)} differ from SentencePiece, first: {wrong[0]}"
