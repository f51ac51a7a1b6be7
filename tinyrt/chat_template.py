"""Chat templates: the model's jinja template, rendered with the same variables as transformers'
`apply_chat_template` (so that prompts match token for token), in a bounded sandbox
(tinyrt.template_sandbox: a template comes inside a downloaded file, so it is untrusted).
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols

from .template_filters import GLOBALS, filters
from .template_sandbox import (FOLD_BYTES, FOLD_CHARS, MAX_SOURCE_CHARS, VALUE_CHARS,
                               ChatTemplateError, Generation, Limits, Sandbox, bounded_block,
                               finalize, limited, one_line, render)

__all__ = ["ChatTemplate", "ChatTemplateError", "MAX_SOURCE_CHARS", "VALUE_CHARS",
           "template_from_config"]


def compile_template(source: str):
    """A template's source -> its jinja2 Template in the sandbox, with transformers' options,
    helpers and variables; ChatTemplateError if it is too long or does not compile."""
    if len(source) > MAX_SOURCE_CHARS:
        raise ChatTemplateError(f"the model's chat template is longer than {MAX_SOURCE_CHARS} "
                                "characters")
    env = Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[Generation, loopcontrols], finalize=finalize)
    env.filters = filters(env.filters)
    env.globals.update(GLOBALS)
    try:
        with limited(Limits(chars=FOLD_CHARS, nbytes=FOLD_BYTES)):
            template = env.from_string(source)
    except (TemplateError, RecursionError, SyntaxError, MemoryError) as e:
        raise ChatTemplateError(f"the model's chat template does not compile: "
                                f"{one_line(e)}") from None
    for name, block in template.blocks.items():
        template.blocks[name] = bounded_block(block)
    return template



class ChatTemplate:
    """A compiled chat template with the tokenizer's special-token strings."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None):
        self.template = compile_template(source)
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for `messages` ([{"role", "content"}, ...]); `extra` are more
        variables for the template (as transformers, `tools` and `documents` are None unless
        given)."""
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ChatTemplateError("each message needs a string 'role' and 'content'")
        text = render(self.template, {"tools": None, "documents": None, **extra,
                                      "messages": messages,
                                      "add_generation_prompt": add_generation_prompt,
                                      "bos_token": self.bos_token, "eos_token": self.eos_token})
        if not text.strip():        # nothing for the model to read (and nothing to tokenize)
            raise ChatTemplateError("the chat template renders an empty prompt")
        return text


def template_from_config(config: dict) -> ChatTemplate | None:
    """The chat template named in a tokenizer config (a string, or a list of named templates of
    which "default" is used), or None when the model has none."""
    from tinyrt.errors import SURROGATE
    from tinyrt.tokenizer import token_text

    src = config.get("chat_template")
    if isinstance(src, list):
        named = {t.get("name"): t.get("template") for t in src if isinstance(t, dict)}
        src = named.get("default")
    if not isinstance(src, str) or not src.strip():
        return None
    # (a lone surrogate, a JSON escape not in a pair, is no text: no tokenizer, no reply and
    # no encoder takes it)
    src = SURROGATE.sub("\ufffd", src)
    return ChatTemplate(src, bos_token=token_text(config.get("bos_token")),
                        eos_token=token_text(config.get("eos_token")))
