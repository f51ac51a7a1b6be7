"""Tokenizers of a model directory or GGUF file, and incremental detokenization for streaming.

`tokenizer.json` is read with HF `tokenizers` (byte-level BPE, SentencePiece-style BPE, ...);
a directory with only `tokenizer.model` is read with `sentencepiece`, special tokens split out of
the text first and each piece of text between them encoded on its own (as llama.cpp does).
`tokenizer_config.json` supplies the BOS/EOS strings, `add_bos_token` and the chat template. A GGUF
file's tokenizer is built from its metadata (tinyrt/gguf_tokenizer.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from tinyrt.errors import ModelFormatError, rust_panic
from tinyrt.paths import (MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, read_bytes, read_json, read_text,
                          shown_path, stat_or_none)


def _read_json(path: Path) -> dict:
    return read_json(path, missing_ok=True) or {}


# Pathological regexes. `tokenizers` matches its patterns with Oniguruma, a backtracking engine:
# a pattern such as `(a+)+$` or `(\w+\s?)*$` takes time exponential in the length of a run of text
# it fails on. Oniguruma gives up after a fixed number of steps, and tokenizers then panics (its
# Rust backtrace printed to stderr first); under that count a long text can keep it busy for
# minutes, and nothing interrupts Rust code. So each pattern is run once at load, by the same
# engine, on short runs of common kinds of text (and of the pattern's own characters), each ended
# by a character that breaks the run: a pathological pattern hits the step limit on one of them in
# a fraction of a second, where a sound one (every real tokenizer's patterns are near linear)
# takes microseconds. (Python's `regex` module, with its timeout, is no judge of them: it
# optimizes `(a+)+` away and passes the very patterns that make Oniguruma panic.) A pattern that
# slips past the probes and panics on some text still ends in one ModelFormatError (_failed).
_PROBE_UNITS = ("a", "A", "1", " ", "\n", "\t", "a ", "ab1 ", "é", "日", "_", "'", "!", ".")
_PROBE_CHARS = 40           # exponential patterns blow up long before this; linear ones stay fast
_PROBE_ENDS = ("!", "\0")
_MAX_PATTERNS = 64          # real tokenizers have a handful; each takes a few ms to probe


def _patterns(node: Any) -> Iterator[str]:
    """The regexes of a tokenizers component's JSON (a Split, a Replace, Sequences of them)."""
    if isinstance(node, dict):
        pattern = node.get("pattern")
        if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
            yield pattern["Regex"]
        for value in node.values():
            yield from _patterns(value)
    elif isinstance(node, list):
        for value in node:
            yield from _patterns(value)


@contextlib.contextmanager
def _stderr_silenced():
    """fd 2 to /dev/null: a panic in the probes below would print a Rust backtrace there."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def check_patterns(tok, where: str) -> None:
    """ModelFormatError naming `where` and the pattern if a regex of the `tokenizers.Tokenizer`
    `tok` (normalizer, pre-tokenizer, decoder, post-processor) backtracks catastrophically."""
    from tokenizers import Regex, pre_tokenizers

    patterns = []
    for part in (tok.normalizer, tok.pre_tokenizer, tok.decoder, tok.post_processor):
        if part is not None:
            patterns += _patterns(json.loads(part.__getstate__()))
    patterns = list(dict.fromkeys(patterns))
    if len(patterns) > _MAX_PATTERNS:
        raise ModelFormatError(f"{where}: {len(patterns)} regex patterns, more than the "
                               f"{_MAX_PATTERNS} tinyrt checks")
    for pattern in patterns:
        split = pre_tokenizers.Split(Regex(pattern), "isolated")
        units = _PROBE_UNITS + tuple(sorted({c for c in pattern if c.isprintable()}))[:64]
        try:
            with _stderr_silenced():
                for unit in units:
                    for end in _PROBE_ENDS:
                        split.pre_tokenize_str(unit * (_PROBE_CHARS // len(unit)) + end)
        except BaseException as e:
            if not (rust_panic(e) or isinstance(e, Exception)):
                raise
            raise ModelFormatError(f"{where}: the pattern {pattern[:80]!r} backtracks "
                                   "catastrophically (it would hang or crash the tokenizer)") from None


def token_text(t: Any) -> str | None:
    """A special-token entry: a string, or an AddedToken dict with "content"."""
    if isinstance(t, dict):
        t = t.get("content")
    return t if isinstance(t, str) else None


class Tokenizer:
    """Text <-> token ids. Use `load_tokenizer(directory)`."""

    def __init__(self, config: dict):
        self.config = config
        self.bos_token = token_text(config.get("bos_token"))
        self.eos_token = token_text(config.get("eos_token"))
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token else None

    # implemented by the two kinds below
    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text become their ids; with
        `add_special`, the BOS (or whatever the tokenizer adds) is added as the model expects."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, i: int) -> str | None:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def special_ids(self) -> set[int]:
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path | Any, config: dict):
        """`path`: a tokenizer.json, or a `tokenizers.Tokenizer` built already."""
        from tokenizers import Tokenizer as _Tok

        self.where = "the GGUF file's tokenizer" if isinstance(path, _Tok) else shown_path(path)
        if isinstance(path, _Tok):
            self.tok = path
        else:
            text = read_text(path, limit=MAX_TOKENIZER_BYTES, error=ModelFormatError)
            try:
                self.tok = _Tok.from_str(text)
            except BaseException as e:  # bare Exceptions on bad files; a PanicException at worst
                if not (isinstance(e, Exception) or rust_panic(e)):
                    raise
                raise ModelFormatError(f"{self.where} is not a valid tokenizer.json "
                                       f"({str(e)[:200]})") from None
        check_patterns(self.tok, self.where)
        super().__init__(config)
        self._special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        try:
            return self.tok.encode(text, add_special_tokens=add_special).ids
        except BaseException as e:
            raise self._failed(e) from None

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        try:
            return self.tok.decode(list(ids), skip_special_tokens=skip_special)
        except BaseException as e:
            raise self._failed(e) from None

    def _failed(self, e: BaseException) -> BaseException:
        """A panic inside tokenizers (one that check_patterns did not foresee) as one line; any
        other exception as it is."""
        if not rust_panic(e):
            return e
        return ModelFormatError(f"{self.where}: the tokenizers library failed ({str(e)[:200]})")

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> set[int]:
        return self._special


class SPTokenizer(Tokenizer):
    def __init__(self, path: Path, config: dict):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor()
        proto = read_bytes(path, limit=MAX_TOKENIZER_BYTES, error=ModelFormatError)
        try:
            self.sp.LoadFromSerializedProto(proto)
            self._init(config)
        except (OSError, RuntimeError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"{path} is not a valid sentencepiece model ({e})") from None

    def _init(self, config: dict) -> None:
        n = self.sp.get_piece_size()
        self._special = {i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)}
        # Control pieces never come out of sentencepiece's own encoding of text, so they are split
        # out first; user-defined pieces sentencepiece already keeps whole.
        splits = {i: self.sp.id_to_piece(i) for i in range(n) if self.sp.is_control(i)}
        # tokens added in tokenizer_config.json (AddedToken dicts keyed by id)
        for key, t in (config.get("added_tokens_decoder") or {}).items():
            text = token_text(t)
            if text and int(key) < n:             # keys checked by tokenizer_config
                splits[int(key)] = text
                if isinstance(t, dict) and t.get("special", True):
                    self._special.add(int(key))
        self._by_text = {t: i for i, t in splits.items() if t}
        # longest first, so that "<|a|>b" wins over "<|a|>" at the same place
        alternatives = sorted(self._by_text, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        # a bare tokenizer.model names its own BOS/EOS
        config = dict(config)
        for key, i in (("bos_token", self.sp.bos_id()), ("eos_token", self.sp.eos_id())):
            if not config.get(key) and i >= 0:
                config[key] = self.sp.id_to_piece(i)
        super().__init__(config)
        self.add_bos = bool(config.get("add_bos_token", True))

    def _fragments(self, text: str) -> Iterable[str | int]:
        """Text pieces and special-token ids, in order."""
        parts = self._split.split(text) if self._split else [text]
        for k, part in enumerate(parts):
            if k % 2:
                yield self._by_text[part]
            elif part:
                yield part

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        ids = [self.bos_id] if add_special and self.add_bos and self.bos_id is not None else []
        for frag in self._fragments(text):
            ids.extend([frag] if isinstance(frag, int) else self.sp.encode(frag))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        ids = [int(i) for i in ids if not (skip_special and i in self._special)]
        return self.sp.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.sp.get_piece_size() else None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def special_ids(self) -> set[int]:
        return self._special


def tokenizer_config(directory: str | Path) -> dict:
    """tokenizer_config.json, with BOS/EOS filled from special_tokens_map.json where missing, and
    the chat template from chat_template.jinja/.json where the config has none."""
    directory = Path(directory)
    path = directory / "tokenizer_config.json"
    config = _read_json(path)
    added = config.get("added_tokens_decoder")
    if added is not None:
        bad = [k for k in added if not (k.isascii() and k.isdigit() and len(k) < 10)] \
            if isinstance(added, dict) else [added]
        if bad:
            raise ModelFormatError(f"{shown_path(path)}: added_tokens_decoder must map token ids to "
                                   f"tokens, not {str(bad[0])[:40]!r}")
    for key, value in _read_json(directory / "special_tokens_map.json").items():
        config.setdefault(key, value)
    if not config.get("chat_template"):
        jinja = read_text(directory / "chat_template.jinja", limit=MAX_JSON_BYTES,
                          missing_ok=True, error=ModelFormatError)
        config["chat_template"] = jinja if jinja is not None else \
            _read_json(directory / "chat_template.json").get("chat_template")
    return config


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of a model directory (tokenizer.json if present, else tokenizer.model) or
    of a GGUF file."""
    directory = Path(directory)
    info = stat_or_none(directory)
    if info is not None and stat.S_ISREG(info.st_mode):
        from tinyrt.gguf_tokenizer import gguf_tokenizer
        from tinyrt.models.gguf import GGUFFile

        return HFTokenizer(*gguf_tokenizer(GGUFFile(directory)))
    config = tokenizer_config(directory)
    if os.path.lexists(directory / "tokenizer.json"):    # a directory or a FIFO: refused as read
        return HFTokenizer(directory / "tokenizer.json", config)
    if os.path.lexists(directory / "tokenizer.model"):
        return SPTokenizer(directory / "tokenizer.model", config)
    raise ModelFormatError(f"{directory} has no tokenizer.json or tokenizer.model")


class Detokenizer:
    """Turns a stream of token ids into text deltas without re-decoding the whole sequence and
    without ever emitting half a UTF-8 character.

    It decodes a short window: `ids`, the tokens whose text was released last (the prefix, up
    to `read`) and the new ones. Text is released once the window decodes to more than its
    prefix and does not end in U+FFFD (the mark of an incomplete byte sequence); the window then
    starts again at the tokens just released, so it stays short however long the stream.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.read = 0    # ids[:read] is the prefix, whose text was already released

    def add(self, token: int) -> str:
        self.ids.append(token)
        done = self.tok.decode(self.ids[:self.read])
        text = self.tok.decode(self.ids)
        if len(text) > len(done) and not text.endswith("\ufffd"):
            del self.ids[:self.read]
            self.read = len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end of the stream."""
        done = self.tok.decode(self.ids[:self.read])
        text = self.tok.decode(self.ids)
        del self.ids[:]
        self.read = 0
        return text[len(done):]
