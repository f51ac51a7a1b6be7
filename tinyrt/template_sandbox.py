"""The bounded jinja2 sandbox chat templates render in (tinyrt.chat_template).

A template comes inside a downloaded file, so it is untrusted: it runs in an
`ImmutableSandboxedEnvironment` with transformers' options, helpers and variables, and its work
is bounded so that a hostile template fails with one clear line instead of hanging or filling
memory. One render (a `Limits`) has a deadline, a number of `for` loop items, a size for any one
value and for the prompt, and a number of bytes for all the values it builds, growing with the
messages given. The checks sit where jinja2 lets a template do work: compiled code
(`_Generator`: loop items, `~`, literals, macro and `{% set %}` buffers), the sandbox's hooks
(`Sandbox`: calls, operators, slices, `str.format`), and filters that can write far more than
they read, measured before they run (`_FILTERS`). Containers can share (a list may hold one big
string many times), so text is estimated before it is made (`measure`), and each container is
measured as it is built (`Limits.tree`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import sys
import threading
import time
import types
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.ext import Extension
from jinja2.runtime import LoopContext
from jinja2.sandbox import (ImmutableSandboxedEnvironment, SandboxedEscapeFormatter,
                            SandboxedFormatter, SecurityError)
from jinja2.utils import Namespace
from markupsafe import Markup

from tinyrt.errors import TinyrtError


class ChatTemplateError(TinyrtError):
    pass


# What one render may use. "Input" is the characters of the messages (and other variables) given.
RENDER_SECONDS = 3.0          # wall-clock time
LOOP_ITEMS = 1_000_000        # items all `for` loops take together, plus one per input character
VALUE_CHARS = 1 << 20         # characters (or items) of any one value, and of the prompt,
CHARS_PER_INPUT_CHAR = 8      # plus this many per input character (tojson escapes up to 6)
VALUE_BYTES = 128 << 20       # bytes of all the values built,
BYTES_PER_INPUT_CHAR = 64     # plus this many per input character
MAX_INT_BITS = 1 << 16        # an integer's size (Python prints at most 4300 digits anyway)
# While compiling: jinja2 computes constant expressions then and writes them into the code, so it
# keeps only small ones (the others are computed when rendering, to the same text).
FOLD_CHARS = 1 << 16
FOLD_BYTES = 4 << 20
MAX_SOURCE_CHARS = 256 << 10  # of a template (real ones: tens of kilobytes at most)
KEEP_TREE = 64                # containers of this many items or more have their size kept
MESSAGE_CHARS = 300           # of a template's text quoted in an error


def one_line(text: Any) -> str:
    """`text` as a short single line, to quote in an error message."""
    text = " ".join(str(text).split())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "..."


class Limits:
    """What one render (or one compile: jinja2 folds constant expressions then) may still use."""

    def __init__(self, input_chars: int = 0, chars: int = VALUE_CHARS, nbytes: int = VALUE_BYTES):
        self.chars = chars + CHARS_PER_INPUT_CHAR * input_chars
        self.items = self.items_allowed = LOOP_ITEMS + input_chars
        self.bytes = self.bytes_allowed = nbytes + BYTES_PER_INPUT_CHAR * input_chars
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.trees: dict[int, tuple[Any, int]] = {}     # id -> (container, its tree size)

    def tick(self):
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template runs for more than {RENDER_SECONDS:g} "
                                    "seconds")

    def step(self):
        """One more `for` loop item."""
        self.items -= 1
        if self.items < 0:
            raise ChatTemplateError(f"the chat template loops over more than {self.items_allowed} "
                                    "items")
        self.tick()

    def fits(self, size: float, noun: str = "a string", unit: str = "characters"):
        """Refuse a value of `size` (an estimate made before building it)."""
        if size > self.chars:
            raise ChatTemplateError(f"the chat template builds {noun} of more than {self.chars} "
                                    f"{unit}")

    def bits(self, bits: float):
        if bits > MAX_INT_BITS:
            raise ChatTemplateError(f"the chat template computes a number of more than "
                                    f"{MAX_INT_BITS} bits")

    def charge(self, nbytes: int):
        self.bytes -= nbytes
        if self.bytes < 0:
            raise ChatTemplateError(f"the chat template builds more than "
                                    f"{self.bytes_allowed >> 20} MiB of values")

    def made(self, value):
        """Check and count a value the template has just built; returns it."""
        self.tick()
        if isinstance(value, (str, bytes)):
            self.fits(len(value))
        elif isinstance(value, _CONTAINERS):
            self.fits(self.tree(value), "a sequence", "items")
        elif isinstance(value, int):
            self.bits(value.bit_length())
        self.charge(_footprint(value))
        return value

    def tree(self, value) -> int:
        """Items in `value` and in all it holds, a shared item counted each time it appears: what
        `==`, hashing, sorting and printing may walk. `[x, x]` built n times over holds 2**n
        items in n lists, so each container is measured as it is built (from the sizes of the
        ones it holds, kept while the render runs)."""
        if not isinstance(value, _CONTAINERS):
            return 1    # (a namespace compares and hashes by identity; its text is measured apart)
        known = self.trees.get(id(value))
        if known is not None:
            return known[1]
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
        size = 1 + len(items) + sum(self.tree(v) - 1 for v in items
                                    if isinstance(v, _CONTAINERS))
        if size >= KEEP_TREE:       # (small ones are measured again when needed, not kept alive)
            self.trees[id(value)] = (value, size)    # (held, so that no other object takes its id)
            self.charge(100)                         # (that entry)
        return size


_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_CONTAINERS = (list, tuple, dict, set, frozenset, *_VIEWS)

_active = threading.local()      # the limits of the render running in this thread


def current_limits() -> Limits:
    limits = getattr(_active, "limits", None)
    return limits if limits is not None else Limits()   # (outside a render: each call on its own)


@contextlib.contextmanager
def limited(limits: Limits):
    """The render (or compile) in this thread uses `limits`."""
    previous = getattr(_active, "limits", None)
    _active.limits = limits
    try:
        yield
    finally:
        _active.limits = previous


def _footprint(value) -> int:
    """Bytes a value just built may hold: a container's items are counted as if new (a list of
    one string many times is charged many times: only a hostile template builds one)."""
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(map(sys.getsizeof, value.keys())) + sum(map(sys.getsizeof, value.values()))
    elif isinstance(value, (list, tuple, set, frozenset)):
        size += sum(map(sys.getsizeof, value))
    return size


def measure(value, limit: int) -> tuple[int, int]:
    """(an upper estimate of the length of `str(value)`, its nesting depth), the walk stopping once
    the length passes `limit`. Strings inside containers count as repr writes them (up to 10
    characters a character: '\\U000e0001'); numbers as their digits."""
    if isinstance(value, str):
        return len(value), 0
    chars, deepest, stack = 0, 0, [(value, 0)]
    while stack and chars <= limit:
        x, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(x, (str, bytes)):
            chars += 10 * len(x) + 3
        elif isinstance(x, bool) or x is None:
            chars += 5
        elif isinstance(x, int):
            chars += x.bit_length() // 3 + 2
        elif isinstance(x, float):
            chars += 24
        elif isinstance(x, dict):
            chars += 2 + 4 * len(x)
            if chars <= limit:
                stack.extend((v, depth + 1) for v in x.keys())
                stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            chars += 2 + 2 * len(x)
            if chars <= limit:
                stack.extend((v, depth + 1) for v in x)
        elif isinstance(x, Namespace):      # its repr shows what it holds
            stack.append((x._Namespace__attrs, depth))
        elif isinstance(x, _VIEWS):
            chars += 20
            stack.append((list(x), depth))
        else:                               # jinja2's own objects, ranges, generators: short reprs
            chars += 200
    return chars, deepest


def text_size(value, limit: int) -> int:
    return measure(value, limit)[0]


def int_or(x, default: int = 0) -> int:
    """An argument that should be an integer (anything else fails in the call itself)."""
    return x if isinstance(x, int) else default


def _digits(text: str | None) -> int:
    return 0 if not text else int(text) if len(text) <= 12 else 10 ** 13


def joined_size(sep, items: list, limit: int) -> int:
    """Characters of `sep.join(map(str, items))`."""
    total = text_size(sep, limit) * max(len(items) - 1, 0)
    for item in items:
        if total > limit:
            break
        total += text_size(item, limit)
    return total


def replaced_size(s, old, new, count: int) -> int:
    """Characters of `s.replace(old, new, count)` (TypeError for mismatched types, as replace)."""
    hits = s.count(old) if old else len(s) + 1
    if count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


# `%` formatting: a field with its mapping key, width and precision
_PERCENT_FIELD = re.compile(r"%(?:\((?P<key>[^)]*)\))?[-#0 +]*(?P<width>\*|\d+)?"
                            r"(?:\.(?P<precision>\*|\d+))?[hlL]?.", re.S)


def percent_size(fmt, values, limit: int) -> int:
    """Characters of `fmt % values`: the text, the values, each field's width and precision."""
    if isinstance(fmt, bytes):
        fmt = fmt.decode("latin-1")
    positional = values if isinstance(values, tuple) else (values,)
    star = max((abs(v) for v in positional if isinstance(v, int)), default=0)  # `*` takes a value
    total = len(fmt) + sum(text_size(v, limit) for v in positional)
    for field in _PERCENT_FIELD.finditer(fmt):
        if total > limit:
            break
        for n in (field["width"], field["precision"]):
            total += star if n == "*" else _digits(n)
        if field["key"] is not None and isinstance(values, dict):     # may repeat one value
            total += text_size(values.get(field["key"]), limit)
    return total


def _noun(value) -> tuple[str, str]:
    """How `Limits.fits` names a value like this one."""
    if isinstance(value, (str, bytes)):
        return "a string", "characters"
    return "a sequence", "items"


def _check_binop(limits: Limits, op: str, a, b):
    """Refuse an operation whose result would be too big, before Python builds it."""
    sized = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(a, int) and isinstance(b, int):
            limits.bits(a.bit_length() + b.bit_length())
            return
        seq, n = (a, b) if isinstance(b, int) else (b, a)
        if isinstance(seq, sized) and isinstance(n, int):
            limits.fits(len(seq) * n, *_noun(seq))
    elif op == "**":
        if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
            limits.bits(b * math.log2(abs(a)))
    elif op == "+":
        if isinstance(a, sized) and isinstance(b, sized):
            limits.fits(len(a) + len(b), *_noun(a))
    elif op == "%" and isinstance(a, (str, bytes)):
        limits.fits(percent_size(a, b, limits.chars))


def _check_text_method(limits: Limits, method, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str (or bytes) method call whose result would be too big; returns the arguments
    to call it with (join's items read once, into a list)."""
    s, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill") and args:
        limits.fits(int_or(args[0]))
    elif name == "expandtabs":
        tab = int_or(args[0] if args else kwargs.get("tabsize", 8))
        limits.fits(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tab, 0))
    elif name == "replace" and len(args) >= 2:
        count = int_or(args[2] if len(args) > 2 else kwargs.get("count", -1), -1)
        limits.fits(replaced_size(s, args[0], args[1], count))
    elif name == "join" and args:
        args = (list(args[0]), *args[1:])
        limits.fits(joined_size(s, args[0], limits.chars))
    elif name == "translate" and args:        # each character may become a whole string
        table = args[0]
        values = (table.values() if isinstance(table, dict)
                  else table if isinstance(table, (list, tuple)) else ())
        longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
        limits.fits(len(s) * max(longest, 1))
    return args


class _Counted:
    """A `for` loop's items, each one counted (and the deadline checked) as the loop takes it."""

    __slots__ = ("_items", "_iterator", "_limits")

    def __init__(self, items, limits: Limits):
        self._items, self._iterator, self._limits = items, iter(items), limits

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._iterator)
        self._limits.step()
        return item

    def __len__(self):      # loop.length (a TypeError where the items have none: jinja2 expects it)
        return len(self._items)


class _Buffer(list):
    """Output that a template collects to join into one string (a macro's, a `{% set %}` block's,
    a filter block's, a recursive loop's): bounded as that string."""

    __slots__ = ("_chars",)

    def __init__(self):
        super().__init__()
        self._chars = 0

    def _add(self, pieces):
        limits = current_limits()
        n = sum(map(len, pieces))
        self._chars += n
        limits.fits(self._chars)
        limits.charge(n + 8 * len(pieces))

    def append(self, piece):
        self._add((piece,))
        super().append(piece)

    def extend(self, pieces):
        pieces = tuple(pieces)
        self._add(pieces)
        super().extend(pieces)


def bounded_block(render_block):
    """A `{% block %}`'s output, counted as it streams: `self.name()` joins it in one call."""

    def bounded(context):
        limits, chars = current_limits(), 0
        for piece in render_block(context):
            chars += len(piece)
            limits.fits(chars)
            limits.charge(len(piece))
            yield piece
    return bounded


class _Generator(CodeGenerator):
    """jinja2's compiler, with loops, `~` and output buffers going through the limits."""

    def visit_For(self, node, frame):
        node.iter = nodes.Call(nodes.EnvironmentAttribute("loop_items"), [node.iter], [], None,
                               None, lineno=node.lineno)
        node.iter.set_environment(self.environment)
        super().visit_For(node, frame)

    @optimizeconst
    def visit_Concat(self, node, frame):
        # (jinja2's choice of join, handed to `Sandbox.joined` with the parts)
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.joined({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def buffer(self, frame):
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")

    def _built(self, visit, node, frame):
        self.write("environment.built(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node, frame):
        self._built(super().visit_List, node, frame)

    def visit_Dict(self, node, frame):
        self._built(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame):
        if node.ctx == "load":          # (not a `for a, b in` target)
            self._built(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)


class _BoundedFields:
    """str.format's fields, measured before each is written."""

    def convert_field(self, value, conversion):
        limits = current_limits()
        limits.fits(text_size(value, limits.chars))       # !r and !a write all of it
        return super().convert_field(value, conversion)

    def format_field(self, value, format_spec):
        limits = current_limits()
        widths = [_digits(d) for d in re.findall(r"\d+", format_spec)]   # width, precision
        limits.fits(text_size(value, limits.chars) + max(widths, default=0))
        text = super().format_field(value, format_spec)
        limits.charge(len(text))
        return text


class _Formatter(_BoundedFields, SandboxedFormatter):
    pass


class _EscapeFormatter(_BoundedFields, SandboxedEscapeFormatter):
    pass


class Sandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _Generator
    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])

    def loop_items(self, items):
        return _Counted(items, current_limits())

    def joined(self, join, parts):
        """`a ~ b`: the parts measured as text before the join writes them."""
        limits = current_limits()
        limits.fits(joined_size("", parts, limits.chars))
        return limits.made(join(parts))

    def output_buffer(self):
        return _Buffer()

    def built(self, value):
        """A list, tuple or dict written in the template."""
        return current_limits().made(value)

    def call(self, context, obj, /, *args, **kwargs):
        limits = current_limits()
        limits.tick()
        # (a macro's `varargs` and `kwargs` are containers built from the arguments; jinja2
        # passes its own `_loop_vars` and `_block_vars`)
        limits.fits(sum(map(limits.tree, args)) + sum(limits.tree(v) for k, v in kwargs.items()
                                                      if k not in ("_loop_vars", "_block_vars")),
                    "a sequence", "items")
        if isinstance(obj, LoopContext) and args:     # `loop(children)` in a recursive for
            args = (_Counted(args[0], limits), *args[1:])
        elif isinstance(getattr(obj, "__self__", None), (str, bytes)):
            args = _check_text_method(limits, obj, args, kwargs)
        return limits.made(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        limits = current_limits()
        _check_binop(limits, operator, left, right)
        return limits.made(super().call_binop(context, operator, left, right))

    def getitem(self, obj, argument):
        value = super().getitem(obj, argument)
        return current_limits().made(value) if isinstance(argument, slice) else value

    def wrap_str_format(self, value):
        """jinja2's sandboxed str.format / format_map, with each field measured."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) \
                or value.__name__ not in ("format", "format_map") \
                or not isinstance(value.__self__, str):
            return None
        text = value.__self__
        formatter = _EscapeFormatter(self, escape=text.escape) if isinstance(text, Markup) \
            else _Formatter(self)
        is_map = value.__name__ == "format_map"

        def format(*args, **kwargs):
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return type(text)(formatter.vformat(text, args, kwargs))
        return functools.update_wrapper(format, value)


def finalize(value):
    """`{{ value }}`: measured as text before it is written."""
    if not isinstance(value, str):
        limits = current_limits()
        limits.fits(text_size(value, limits.chars))
    return value


class Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's text for
    training): its body, as transformers renders it when not asked for that mask."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _input_chars(value) -> int:
    """Characters of the strings a render is given (its sizes grow with them)."""
    chars, stack = 0, [value]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            chars += len(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return chars



def render(template, variables: dict[str, Any]) -> str:
    """The text `template` (from compile_template) renders with `variables`, its work bounded
    by limits that grow with the strings given; every failure one ChatTemplateError."""
    limits = Limits(_input_chars(list(variables.values())))
    pieces, chars = [], 0
    try:
        with limited(limits):
            for piece in template.generate(**variables):
                chars += len(piece)
                limits.fits(chars, "a prompt")
                pieces.append(piece)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"the chat template tried something unsafe: "
                                f"{one_line(e)}") from None
    except MemoryError:
        raise ChatTemplateError("the chat template ran out of memory") from None
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError,
            ArithmeticError, RuntimeError, AssertionError) as e:  # (truncate asserts)
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: "
                                f"{one_line(e)}") from None
    return "".join(pieces)
