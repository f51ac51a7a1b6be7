"""Options shared by the front ends (one vocabulary, docs/DESIGN.md)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from tinyrt.errors import TinyrtError, printable, shown
from tinyrt.kernels import DEVICES
from tinyrt.sampling import (DEFAULT_REPEAT_PENALTY, SamplingParams, check_settings,
                             is_text)


def add_model_option(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """-m/--model, and with `positional` an optional MODEL argument meaning the same
    (`model_spec` reads either; before a required positional, as generate's PROMPT, it is MODEL
    where two are given)."""
    if positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as -m MODEL")
    p.add_argument("-m", "--model", default=None,
                   help="model directory, GGUF file, known name or Hugging Face id "
                        "(org/name[:QUANT]) (default: the default model)")


def add_raw_output_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw-output", action="store_true",
                   help="write the model's text as generated, escape sequences and control "
                        "characters included (default: shown as visible \\x1b escapes, so "
                        "that a model cannot retitle, clear or recolour the terminal)")


def model_spec(args: argparse.Namespace):
    """The MODEL given with -m or as the positional argument (None: the default model)."""
    given = {m for m in (args.model, getattr(args, "model_pos", None)) if m is not None}
    if len(given) > 1:
        raise TinyrtError(f"two models given, {args.model_pos} and -m {args.model}: give one")
    return given.pop() if given else None


# An integer as Python writes one (int() takes the same): an option's value in this form is never
# read as a float, not even where int() refuses it (over 4,300 digits), where float() would make
# it inf and the message would name a value the user did not give.
_INTEGER = re.compile(r"\s*[+-]?\d+(?:_\d+)*\s*")


def number(text: str):
    """An option's value as an int, else a float, else the text as given: the option's own
    check (sampling.check_settings, bench.check_args) says what is wrong with it, in the words
    it uses for every front end. The one parse of the numbers of the options that take ints or
    floats (whole numbers have `whole`); the checks take any size of int and nan or inf."""
    try:
        return int(text)
    except ValueError:
        if _INTEGER.fullmatch(text):          # (too long for int(): out of every range)
            return text
    try:
        return float(text)
    except ValueError:
        return text


def whole(text: str) -> int:
    """An option's value as an int (argparse's `type` for whole-number options): the one parse of
    them, its refusal one line that shows the value cut short; the range is the option's own
    check's (kv_cache.CacheOptions, api.check_runtime, ...), which takes an int of any size."""
    value = number(text)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{shown(value.strip())} is out of range "
                                         f"({len(value.strip()):,} digits)")
    raise argparse.ArgumentTypeError(f"not a whole number: {shown(text)}")


def text_arg(value: str | None, name: str) -> str | None:
    """An argument's text, or a TinyrtError naming it where it is not UTF-8 (Python hands such
    bytes over surrogate-escaped, which no tokenizer takes)."""
    if value is None or is_text(value):
        return value
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise TinyrtError(f"{name} is not valid Unicode text") from None
    return decode_text(raw, name)


def decode_text(raw: bytes, name: str) -> str:
    """UTF-8 bytes as text, or a TinyrtError naming `name` and the first byte that is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TinyrtError(f"{name} is not valid UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                          f"{e.start})") from None


def read_stdin(name: str, limit: int) -> str:
    """All of stdin as text: at most `limit` bytes (more is refused, unread), UTF-8."""
    if sys.stdin is None:
        raise TinyrtError(f"{name} '-' reads stdin, which is closed")
    raw = sys.stdin.buffer.read(limit + 1)
    if len(raw) > limit:
        raise TinyrtError(f"{name} on stdin is over {limit:,} bytes, more than tinyrt tokenizes")
    return decode_text(raw, f"{name} on stdin")


def add_generation_options(p: argparse.ArgumentParser) -> None:
    # numbers are read leniently and checked, with the options of every front end, by
    # sampling.check_settings (generation_kwargs), before the model loads
    default = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    g = p.add_argument_group(
        "generation", "Sampling defaults: the model's own (its generation_config.json, its "
                      "GGUF metadata) where it has them, else tinyrt's: temperature "
                      f"{default['temperature']}, top-p {default['top_p']}, llama.cpp's top-k "
                      f"{default['top_k']} and min-p {default['min_p']}, ollama's repeat penalty "
                      f"{DEFAULT_REPEAT_PENALTY} (`tinyrt info MODEL` says which apply).")
    g.add_argument("-n", "--max-tokens", "--n-predict", type=number, default=512, metavar="N",
                   help="most tokens to generate (--n-predict: llama.cpp's name)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="go on past end-of-sequence tokens, to --max-tokens")
    g.add_argument("--temperature", type=number, default=None,
                   help=f"0 = greedy, the same reply every time (below 1e-5 is 0) "
                        f"(default {default['temperature']})")
    g.add_argument("--top-k", type=number, default=None,
                   help=f"when sampling; 0 = off (default {default['top_k']})")
    g.add_argument("--top-p", type=number, default=None,
                   help=f"when sampling; 1 = off (default {default['top_p']})")
    g.add_argument("--min-p", type=number, default=None,
                   help=f"when sampling; 0 = off (default {default['min_p']})")
    g.add_argument("--repeat-penalty", type=number, default=None,
                   help=f"0.01 to 100; 1 = off (default {DEFAULT_REPEAT_PENALTY} when sampling, "
                        f"1 with --temperature 0)")
    g.add_argument("--seed", type=number, default=None,
                   help="random seed for sampling, 0 to 2**64-1 (-1 = random, the default)")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text appears (repeatable)")
    r = p.add_argument_group("runtime")
    add_cache_options(r, policy="dense")
    add_draft_options(r)
    add_runtime_options(r)


def add_runtime_options(g) -> None:
    """Where and how the weights run: --device, --threads, --dtype (and llama.cpp's -ngl, which
    `load_options` answers with a note)."""
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: the GPU where CUDA runs, else the CPU (default auto)")
    # taken so that a llama.cpp command line runs (its -ngl 99 was read as -n gl); any value
    g.add_argument("-ngl", "--n-gpu-layers", default=None, metavar="N",
                   help="llama.cpp's layers on the GPU: ignored with a note; tinyrt runs every "
                        "layer on the one device --device picks")
    g.add_argument("--threads", type=whole, default=None,
                   help="the most threads of the CPU kernels, 1 to the CPUs this process may use "
                        "(default: all of them); fewer while other programs keep cores busy")
    g.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="on a GPU, run each decode step's kernels one by one instead of replaying "
                        "them as one CUDA graph (debugging)")
    g.add_argument("--dtype", choices=["f16", "f32"], default=None,
                   help="run on float weights of this type (quantized weights dequantized at "
                        "load); default: the weights as stored, a quantized model on its "
                        "quantized kernels")


def add_draft_options(g) -> None:
    from tinyrt.speculative import MAX_GAMMA

    g.add_argument("--draft", default=None, metavar="MODEL|lookup|layers:N",
                   help="speculative decoding: a draft model with the same vocabulary, 'lookup' "
                        "(drafts copied from earlier text: replies that quote the prompt) or "
                        "'layers:N' (the model's own first N layers)")
    g.add_argument("--draft-tokens", type=whole, default=MAX_GAMMA,
                   help=f"most tokens drafted per step; the number adapts, and a draft model "
                        f"stops sooner where it is unsure (default {MAX_GAMMA})")


def add_cache_options(g, *, policy: str, size: int | None = None, ctx_size: bool = True) -> None:
    """The KV cache options (`g` a parser or argument group): policy, size, sinks, recent, type.
    `ctx_size`: --kv-size answers to llama.cpp's -c/--ctx-size too (the size of its KV cache;
    not in ppl, where -c is the window, as in llama-perplexity)."""
    from tinyrt.kv_options import DEFAULT_GROUPS, DEFAULT_RESIDUAL, KV_TYPES, POLICY_NAMES

    g.add_argument("--kv-policy", choices=list(POLICY_NAMES), default=policy,
                   help="KV cache policy: dense (fill, then stop), sink (StreamingLLM: keep the "
                        "first --sinks tokens and a ring of the most recent; streams forever) or "
                        f"h2o (sinks, --recent tokens and the heavy hitters; streams) (default {policy})")
    names = ("--kv-size", "-c", "--ctx-size") if ctx_size else ("--kv-size",)
    g.add_argument(*names, dest="kv_size", type=whole, default=None, metavar="N",
                   help="KV cache size in tokens" + (f" (default {size})" if size else
                                                     " (default: the model context, at most 4096)")
                   + ("; -c/--ctx-size: llama.cpp's names" if ctx_size else ""))
    g.add_argument("--kv-mem", default=None, metavar="SIZE",
                   help="KV cache size as memory, e.g. 512MB or 2GiB: as many tokens as fit "
                        "(instead of --kv-size)")
    g.set_defaults(kv_size_default=size)
    g.add_argument("--sinks", type=whole, default=4,
                   help="attention sinks kept by sink and h2o (default 4; 0 with sink: a sliding window)")
    g.add_argument("--recent", type=whole, default=None,
                   help="recent tokens kept by h2o (default 64, at most half of the cache less "
                        "the sinks; the rest holds the heavy hitters)")
    g.add_argument("--kv-type", choices=list(KV_TYPES), default="f16",
                   help="KV cache element type: f16, f32, or KIVI codes of 8, 4 or 2 bits, keys "
                        "per channel and values per token (q4: a quarter of f16's memory) "
                        "(default f16)")
    g.add_argument("--kv-group", type=whole, default=None,
                   help="q8/q4/q2: tokens per key scale and channels per value scale, a power "
                        "of two (default " + ", ".join(f"{t} {n}" for t, n in DEFAULT_GROUPS.items())
                        + ")")
    g.add_argument("--kv-residual", type=whole, default=DEFAULT_RESIDUAL,
                   help="q8/q4/q2: the most recent tokens kept in float16 until a group of them "
                        f"is full (default {DEFAULT_RESIDUAL})")


def cache_options(args: argparse.Namespace):
    """The KV cache options (kv_cache.CacheOptions) given on the command line."""
    from tinyrt.kv_options import CacheOptions

    size = args.kv_size if args.kv_size is not None or args.kv_mem else args.kv_size_default
    return CacheOptions(kv_policy=args.kv_policy, kv_size=size, kv_mem=args.kv_mem,
                        kv_type=args.kv_type, sinks=args.sinks, recent=args.recent,
                        kv_group=args.kv_group, kv_residual=args.kv_residual)


def generation_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for `LLM.stream` from parsed options, checked (before the model loads:
    a TinyrtError naming the flag)."""
    stop = [text_arg(s, "--stop") for s in args.stop]
    options = check_settings(dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed,
        stop=stop, ignore_eos=args.ignore_eos), flags=True)
    return dict(options, system=text_arg(args.system, "--system"))


def load_options(args: argparse.Namespace, cache=None) -> dict:
    """Keyword arguments for `tinyrt.load` from parsed options, the model among them, checked
    before the model loads (a TinyrtError naming the flag); `cache` (kv_cache.CacheOptions) in
    place of the command's cache options (bench and ppl size their own)."""
    from tinyrt.api import check_runtime

    draft = dict(draft=args.draft, draft_tokens=args.draft_tokens) if hasattr(args, "draft") \
        else {}                                   # (ppl has no draft options)
    check_runtime(args.threads, draft.get("draft_tokens"))
    if args.n_gpu_layers is not None:
        device = "auto: the GPU where CUDA runs, else the CPU" if args.device == "auto" \
            else args.device
        print(f"note: -ngl/--n-gpu-layers is llama.cpp's, ignored: tinyrt runs every layer on "
              f"one device, the one --device picks ({device})", file=sys.stderr, flush=True)
    return dict(model=model_spec(args), device=args.device, threads=args.threads,
                dtype=args.dtype, cuda_graph=args.cuda_graph, cache=cache or cache_options(args),
                **draft)


def load_llm(args: argparse.Namespace, options: dict | None = None):
    """The model the command names, loaded with `options` (default: `load_options(args)`)."""
    import tinyrt

    return tinyrt.load(**(options or load_options(args)))


def speculative_line(t) -> str:
    """The drafts' figures of a reply's timings (empty without a draft)."""
    s = t.speculative
    if s is None:
        return ""
    return (f"draft {printable(s.drafter)}: {s.accepted}/{s.drafted} accepted ({s.accept_rate:.0%}) · "
            f"{s.tokens_per_step:.2f} tokens per target pass · gamma {s.gamma} · "
            f"draft {s.draft_s:.2f} s, target {s.target_s:.2f} s")
