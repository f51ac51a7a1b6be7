"""A `tokenizer.json` (HF `tokenizers`) built from a GGUF file's tokenizer metadata.

GGUF stores the vocabulary, merges, token types and a pre-tokenizer name (`tokenizer.ggml.pre`);
llama.cpp, the format's reference implementation, maps that name to regex splits. We build the same
splits with `tokenizers`, so that a converted model tokenizes as llama.cpp does with the file.

Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
"""

from __future__ import annotations

from typing import Any

from tinyrt.errors import ModelFormatError, rust_panic

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp pre-tokenizer name -> the regexes it splits with, applied in turn
PRE_TOKENIZERS: dict[str, list[str]] = {}
for _names, _splits in [
    (("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe"), [_GPT2]),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     [r"\p{N}", _GPT2]),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), [_LLAMA3]),
    (("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"), [_QWEN2]),
    (("tekken",), [_TEKKEN]),
    (("gpt-4o", "llama4"), [_GPT4O]),
]:
    for _n in _names:
        PRE_TOKENIZERS[_n] = _splits

# pre-tokenizers whose BPE takes a whole pre-token found in the vocabulary as one token, without
# merging (llama.cpp's ignore_merges; HF's tokenizer.json says "ignore_merges": true)
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"}

CONTROL, USER_DEFINED = 3, 4


def _byte_level(pre: str):
    from tokenizers import Regex, decoders, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise ModelFormatError(f"GGUF pre-tokenizer {pre!r} is not supported "
                               f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    pre_tok = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pre_tok, decoders.ByteLevel()


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a normal piece into two
    pieces of the vocabulary, ranked by the piece's score (highest first), as llama.cpp's SPM
    tokenizer merges the adjacent pair whose result scores highest."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types and types[i] != 1:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_tokenizer(meta: dict[str, Any]):
    """A `tokenizers.Tokenizer` from GGUF tokenizer metadata (keys without `tokenizer.ggml.`)."""
    try:
        return _build_tokenizer(meta)
    except (ModelFormatError, MemoryError):
        raise
    except BaseException as e:  # tokenizers raises bare Exceptions on bad input, and panics
        if not (isinstance(e, Exception) or rust_panic(e)):
            raise
        why = " ".join(str(e).split())[:200]      # (its messages run over several lines)
        raise ModelFormatError(f"the GGUF file's tokenizer is unusable ({type(e).__name__}: "
                               f"{why})") from None


def _build_tokenizer(meta: dict[str, Any]):
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    kind = meta.get("model")
    tokens: list[str] = list(meta.get("tokens") or [])
    types: list[int] = [int(t) for t in (meta.get("token_type") or [])]
    if not tokens:
        raise ModelFormatError("the GGUF file has no tokenizer vocabulary")
    if types and len(types) != len(tokens):
        raise ModelFormatError("the GGUF tokenizer has token types for "
                               f"{len(types)} of {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("merges") or []]
        pre = meta.get("pre") or "default"
        tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                            ignore_merges=pre in IGNORE_MERGES))
        tok.pre_tokenizer, tok.decoder = _byte_level(pre)
        add_bos_default = False
    elif kind == "llama":
        scores = [float(s) for s in (meta.get("scores") or [0.0] * len(tokens))]
        unk = meta.get("unknown_token_id")
        merges = meta.get("merges")
        merges = ([tuple(m.split(" ", 1)) for m in merges] if merges
                  else spm_merges(tokens, scores, types))
        tok = Tokenizer(BPE(vocab, merges, unk_token=tokens[unk] if unk is not None else None,
                            fuse_unk=True, byte_fallback=True))
        prefix = bool(meta.get("add_space_prefix", True))
        norms = ([normalizers.Prepend("\u2581")] if prefix else []) + [
            normalizers.Replace(" ", "\u2581")]
        tok.normalizer = normalizers.Sequence(norms)
        decs = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            decs.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(decs)
        add_bos_default = True
    else:
        raise ModelFormatError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")

    added = [AddedToken(t, special=(ty == CONTROL), normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)
    add_bos = meta.get("add_bos_token")
    add_bos = add_bos_default if add_bos is None else bool(add_bos)
    bos = meta.get("bos_token_id")
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], int(bos))])
    return tok, add_bos


def tokenizer_config(meta: dict[str, Any], chat_template: str | None, add_bos: bool) -> dict:
    """The `tokenizer_config.json` of a GGUF's tokenizer metadata."""
    tokens = meta["tokens"]

    def name(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"),
        "pad_token": name("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    if chat_template:
        config["chat_template"] = chat_template
    return {k: v for k, v in config.items() if v is not None}


def gguf_tokenizer(gguf) -> tuple[Any, dict]:
    """A GGUF file's (models.gguf.GGUFFile) tokenizer, built from its metadata: the
    `tokenizers.Tokenizer` and its tokenizer_config.json."""
    meta = {k[len("tokenizer.ggml."):]: gguf.get(k) for k in gguf.metadata
            if k.startswith("tokenizer.ggml.")}
    tok, add_bos = build_tokenizer(meta)
    return tok, tokenizer_config(meta, gguf.get("tokenizer.chat_template"), add_bos)


def tokenizer_files(gguf) -> dict[str, str]:
    """`tokenizer.json` and `tokenizer_config.json` contents for a GGUF file's tokenizer."""
    import json

    tok, config = gguf_tokenizer(gguf)
    return {"tokenizer.json": tok.to_str(pretty=False),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False)}
