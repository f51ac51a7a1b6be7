"""tinyrt's GGUF tokenizer against llama.cpp's own test vectors: each vocabulary-only GGUF of a
family tinyrt runs (`ggml-vocab-NAME.gguf`, as llama.cpp's converter wrote it) gives, on every
string of its `.inp` file, the ids llama.cpp gives (its `.out` file; no BOS)."""

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
