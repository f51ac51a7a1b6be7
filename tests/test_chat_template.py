import json
import re
import resource

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import CHATML, HOSTILE_SECONDS, assert_refused, fuzz, run_tinyrt, write_tiny_model
from tinyrt.chat_template import (MAX_SOURCE_CHARS, VALUE_CHARS, ChatTemplate, ChatTemplateError,
                                  template_from_config)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke 😀\nwith two lines"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6"}, {"role": "user", "content": "<|im_end|> tricky"}],
]


@pytest.mark.real_model
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_prompt_ids_equal_transformers_apply_chat_template(smol, hf_gguf_tokenizer, messages):
    import tinyrt

    llm = tinyrt.LLM(smol)
    want = hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert llm.prompt_ids(messages) == list(want)


def test_system_message_option_replaces_the_system_turn():
    t = ChatTemplate(CHATML)
    from tinyrt.api import chat_messages

    msgs = chat_messages([{"role": "system", "content": "old"}, {"role": "user", "content": "q"}],
                         system="new")
    assert t.render(msgs) == "<|im_start|>system\nnew<|im_end|>\n<|im_start|>user\nq<|im_end|>\n" \
                             "<|im_start|>assistant\n"


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append({'role': 'x'}) %}{{ x }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
])
def test_template_cannot_reach_python_internals(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("source, match", [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "loops"),
    ("{% for m in range(20) %}{% for b in range(90000) %}{% endfor %}{% endfor %}", "loops"),
    ("{{ 'x' * 1000000000 }}", "string of more than"),
    ("{{ messages * 2000000 }}", "sequence"),
    ("{{ 2 ** 100000000 }}", "bits"),
])
def test_template_work_is_bounded(source, match):
    """Templates that would hang or fill memory fail at once; a budget is per render."""
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    t = ChatTemplate("{% for m in range(6) %}{% for b in range(90000) %}{% endfor %}{% endfor %}"
                     "{{ ('ab' * 3)|length }}{{ 2 ** 10 }}")
    assert t.render([]) == t.render([]) == "61024"


def test_raise_exception_and_broken_templates():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="'role' and 'content'"):
        ChatTemplate(CHATML).render([{"role": "user"}])


def test_named_templates_and_missing_template():
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert template_from_config(cfg).render([]) == "D"
    assert template_from_config({}) is None
    assert template_from_config({"chat_template": "  "}) is None


def test_bos_token_and_tojson_helpers():
    t = ChatTemplate("{{ bos_token }}{{ messages | tojson }}", bos_token="<s>")
    assert t.render([{"role": "user", "content": "é"}]) == '<s>[{"role": "user", "content": "é"}]'


# -- real templates render as transformers renders them -----------------------------------------
# (written after Llama 3.1's, Mistral's, Gemma's, DeepSeek-R1's, Phi-3's and Zephyr's; MISC uses
# most of what jinja2 offers a template: macros, namespaces, filters, methods, recursive loops)

LLAMA3 = (
    "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n"
    "{%- endif %}\n{%- if not tools_in_user_message is defined %}\n    "
    "{%- set tools_in_user_message = true %}\n{%- endif %}\n"
    '{%- if not date_string is defined %}\n    {%- set date_string = "26 Jul 2024" %}\n'
    "{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n"
    "{%- if messages[0]['role'] == 'system' %}\n    "
    "{%- set system_message = messages[0]['content']|trim %}\n    "
    '{%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = "" %}\n'
    '{%- endif %}\n\n{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{%- if tools is not none %}\n    {{- "Environment: ipython\\n" }}\n{%- endif %}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{%- if tools is not none and not tools_in_user_message %}\n    {%- for t in tools %}\n"
    '        {{- t | tojson(indent=4) }}\n        {{- "\\n\\n" }}\n    {%- endfor %}\n'
    '{%- endif %}\n{{- system_message }}\n{{- "<|eot_id|>" }}\n\n{%- for message in messages %}\n'
    "    "
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        "
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n        "
    "{%- set tool_call = message.tool_calls[0].function %}\n        "
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n        "
    '{{- \'{"name": "\' + tool_call.name + \'", \' }}\n        {{- \'"parameters": \' }}\n'
    '        {{- tool_call.arguments | tojson }}\n        {{- "}" }}\n        '
    '{{- "<|eot_id|>" }}\n    {%- else %}\n        '
    '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n        '
    "{%- if message.content is mapping or message.content is iterable %}\n            "
    "{{- message.content | tojson }}\n        {%- else %}\n            {{- message.content }}\n"
    '        {%- endif %}\n        {{- "<|eot_id|>" }}\n    {%- endif %}\n{%- endfor %}\n'
    "{%- if add_generation_prompt %}\n    "
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n")

MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}\n    "
    "{%- set system_message = messages[0]['content'] %}\n    "
    "{%- set loop_messages = messages[1:] %}\n{%- else %}\n    "
    "{%- set loop_messages = messages %}\n{%- endif %}\n\n{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n    "
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n        "
    "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n    {%- if message['role'] == 'user' %}\n        "
    "{%- if loop.first and system_message is defined %}\n            "
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n        "
    "{%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n        "
    "{%- endif %}\n    {%- elif message['role'] == 'assistant' %}\n        "
    "{{- ' ' + message['content'] + eos_token}}\n    {%- else %}\n        "
    "{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n{%- endfor %}\n")

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

DEEPSEEK_R1 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}"
    "{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}")

MISC = (
    "{%- macro render(m, i) -%}[{{ i }}:{{ m.role|upper }}|{{ '%-6s'|format(m.role) }}|"
    "{{ '{:>8}'.format(m.role) }}]{{ m.content|replace('\\n', ' / ')|truncate(60) }}"
    "{%- endmacro -%}{%- set ns = namespace(last_user=-1, words=0) -%}{%- for m in messages -%}"
    "{%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}"
    "{%- set ns.words = ns.words + m.content.split()|length -%}{%- endfor -%}"
    "{{ messages|map(attribute='role')|join(',') }}|"
    "{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|{{ ns.last_user }}|"
    "{{ ns.words }}|{{ (messages|length) ** 2 }}|{{ messages[-1].content|wordcount }}\n"
    "{%- for m in messages %}{{ render(m, loop.index) }}{{ m.content|center(30)|length }}"
    "{{ m.content[:5]|indent(2) }}{{ loop.cycle('a', 'b') }}{% if not loop.last %}~{% endif %}"
    "{% endfor -%}{{ messages[0]|tojson(indent=2, sort_keys=true) }}"
    "{{ messages|tojson(separators=(',', ':')) }}"
    "{{ {'n': messages|length, 'x': [1, 2.5, none, true]}|tojson }}{{ range(3)|list }}"
    "{{ [3, 1, 2]|sort|join }}{{ messages|groupby('role')|map(attribute='grouper')|join('/') }}"
    "{{ ('%s-%d' % ('x', 7)) ~ (1, 2) ~ 'y' * 3 }}"
    "{{ messages[0].content.strip().title().startswith('W') }}"
    "{{ lipsum(1, false, 5, 6)|wordcount > 0 }}{% for k, v in messages[0]|dictsort %}{{ k }}="
    "{{ v|length }};{% endfor %}{{ messages[0].items()|list|length }}"
    "{% for x in [[1, [2]], [3, [4]]] recursive %}<{% if x is iterable %}{{ loop(x) }}{% else %}"
    "{{ x }}{% endif %}>{% endfor %}{% set text %}{% filter upper %}block {{ messages|length }}"
    "{% endfilter %}{% endset %}{{ text }}{{ tools|tojson if tools is not none else 'no tools' }}"
    "{{ documents is none }}{% if add_generation_prompt %}{% generation %}ASSISTANT:"
    "{% endgeneration %}{% endif %}")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
REAL = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "gemma": GEMMA,
        "deepseek-r1": DEEPSEEK_R1, "phi3": PHI3, "zephyr": ZEPHYR, "misc": MISC}


@pytest.mark.parametrize("source", REAL.values(), ids=REAL.keys())
def test_templates_render_as_transformers_renders_them(source):
    from jinja2 import TemplateError

    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    if not hasattr(utils, "render_jinja_template"):
        pytest.skip("this transformers renders templates only inside a tokenizer")
    long_chat = [{"role": ("user", "assistant")[i % 2],
                  "content": f"<think>{i}</think> " + "word " * 300} for i in range(400)]
    for messages in [*CONVERSATIONS, long_chat]:
        for tools in (None, TOOLS):
            template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
            try:
                (want,), _ = utils.render_jinja_template(
                    [messages], tools=tools, chat_template=source, add_generation_prompt=True,
                    bos_token="<s>", eos_token="</s>")
            except TemplateError:
                with pytest.raises(ChatTemplateError):
                    template.render(messages, tools=tools)
            else:
                assert template.render(messages, tools=tools) == want


# -- hostile templates: every kind fails with one line, quickly, in bounded memory -------------

PEAK_BYTES = 384 << 20     # Python memory a refused render may take (values: 128 MiB, and one more)
LONG = [{"role": "user", "content": "x" * 3000}]

RENDERER = """
import json, sys, time, tracemalloc
from tinyrt.chat_template import ChatTemplate, ChatTemplateError
for line in sys.stdin:
    job = json.loads(line)
    tracemalloc.start()
    start = time.monotonic()
    try:
        result = {"chars": len(ChatTemplate(job["source"]).render(job["messages"]))}
    except ChatTemplateError as e:
        result = {"error": str(e)}
    except BaseException as e:
        result = {"crash": f"{type(e).__name__}: {e}"[:1000]}
    result.update(seconds=time.monotonic() - start, peak=tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    print(json.dumps(result), flush=True)
"""


class Renderer:
    """A child process that renders templates for the tests, so that a template that escapes the
    limits fails its test instead of hanging the tests (a C call that Python cannot interrupt) or
    filling the machine (the child's address space is capped at 3 GiB). `render` gives the child's
    answer: "chars" (the prompt's length) or "error" (ours) or "crash" (anything else), and the
    "seconds" and "peak" (tracemalloc: every string, list and int a template builds) it took."""

    def __init__(self):
        self.child = None

    def render(self, source: str, messages: list) -> dict:
        import select
        import subprocess
        import sys

        if self.child is None:
            def cap():
                resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY))
            self.child = subprocess.Popen([sys.executable, "-c", RENDERER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, preexec_fn=cap)
        self.child.stdin.write(json.dumps({"source": source, "messages": messages}) + "\n")
        self.child.stdin.flush()
        if select.select([self.child.stdout], [], [], HOSTILE_SECONDS)[0]:
            line = self.child.stdout.readline()
            if line:
                return json.loads(line)
        self.close()
        pytest.fail(f"the render hung or died (after {HOSTILE_SECONDS} s at most): {source[:200]}")

    def close(self):
        if self.child is not None:
            self.child.kill()
            self.child.wait()
            self.child = None


@pytest.fixture(scope="module")
def renderer():
    r = Renderer()
    yield r
    r.close()


def assert_bounded(result: dict, source: str):
    assert "crash" not in result, (result, source)
    assert "\n" not in result.get("error", ""), result
    assert result["peak"] < PEAK_BYTES, (result, source)


def loops(body: str, outer: int, inner: int) -> str:
    """`body` run outer * inner times (jinja2's sandbox allows ranges of 100000 at most)."""
    return (f"{{% for i in range({outer}) %}}{{% for j in range({inner}) %}}{body}"
            "{% endfor %}{% endfor %}")


def doubled(op: str, times: int) -> str:
    """ns.s doubled `times` times with `op`."""
    return NS + f"{{% for i in range({times}) %}}{{% set ns.s = ns.s {op} ns.s %}}{{% endfor %}}"


NS = "{% set ns = namespace(s='ab', a=[], b=[], t=(), l=[]) %}"
SHARED = "{% set l = ['x' * 100000] * 100000 %}"       # 10 GB of text in 800 KB of pointers
BIG = "{% set s = 'x' * 100000 %}"
LOOPED = "A" * 2000
STRING, SEQUENCE, NUMBER, BYTES = ("string of more than", "sequence of more than",
                                   "number of more than", "MiB of values")
HOSTILE = {
    "nested loops over a built string": (
        doubled("~", 10) + "{% for a in ns.s %}{% for b in ns.s %}{% endfor %}{% endfor %}",
        "loops over|seconds"),
    "nested loops over a message": (
        "{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% endfor %}"
        "{% endfor %}{% endfor %}", "loops over|seconds"),
    "an integer squared in a loop": (
        "{% set ns = namespace(x=2) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}{{ ns.x }}", NUMBER),
    "a power": ("{{ 3 ** 1000000000 }}", NUMBER),
    "a printf width": ("{{ '%03000000000d' % 1 }}", STRING),
    "a printf precision": ("{{ '%.300000000f' % 1.0 }}", STRING),
    "a printf * width": ("{{ '%*d' % (3000000000, 1) }}", STRING),
    "a printf key repeated": (BIG + "{{ ('%(a)s' * 1000) % {'a': s} }}", STRING),
    "a format width": ("{{ '{:>3000000000}'.format(1) }}", STRING),
    "a format width argument": ("{{ '{:>{}}'.format(1, 3000000000) }}", STRING),
    "a format_map width": ("{{ '{a:>3000000000}'.format_map({'a': 1}) }}", STRING),
    "a format field repeated": (
        "{% set s = 'x' * 1000000 %}{{ ('{0}' * 1000).format(s) }}", f"{BYTES}|{STRING}"),
    "a format repr of a shared list": (SHARED + "{{ '{!r}'.format(l) }}", "more than"),
    "|format width": ("{{ '%03000000000d'|format(1) }}", STRING),
    "|center": ("{{ 'x'|center(3000000000) }}", STRING),
    "str.center": ("{{ 'x'.center(3000000000) }}", STRING),
    "str.ljust": ("{{ 'x'.ljust(3000000000) }}", STRING),
    "str.zfill": ("{{ '1'.zfill(3000000000) }}", STRING),
    "str.expandtabs": ("{{ ('\\t' * 100000).expandtabs(100000) }}", STRING),
    "|tojson indent": ("{{ messages|tojson(indent=3000000000) }}", STRING),
    "|tojson indent string": ("{{ [[[[[[[[[[1]]]]]]]]]]|tojson(indent='x' * 1000000) }}", STRING),
    "|tojson of a shared list": (SHARED + "{{ l|tojson }}", "more than"),
    "lipsum": ("{{ lipsum(n=100000000) }}", STRING),
    "|indent width": ("{{ 'a\\nb'|indent(width=3000000000) }}", STRING),
    "|indent width string": ("{{ ('\\n' * 100000)|indent(width='x' * 100000) }}", STRING),
    "|wordwrap wrapstring": ("{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 100000) }}", STRING),
    "|wordwrap long word": ("{{ ('a' * 300000)|wordwrap(1, wrapstring='') }}", BYTES),
    "~ doubling": (doubled("~", 40) + "{{ ns.s }}", STRING),
    "+ doubling": (doubled("+", 40) + "{{ ns.s }}", STRING),
    "list doubling": (
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}"
        "{% endfor %}{{ ns.l|length }}", f"{SEQUENCE}|seconds"),   # (busy machine: time first)
    "|join of a shared list": (SHARED + "{{ l|join }}", "more than"),
    "str.join": (BIG + "{{ s.join(s) }}", STRING),
    "str.replace of ''": (BIG + "{{ s.replace('', s) }}", STRING),
    "|replace": (BIG + "{{ s|replace('x', s) }}", STRING),
    "str.translate": (BIG + "{{ s.translate({120: s}) }}", STRING),
    "|string of a shared list": (SHARED + "{{ l|string|length }}", "more than"),
    "output of a shared list": (SHARED + "{{ l }}", "more than"),
    "~ of a shared list": (SHARED + "{{ (l ~ '')|length }}", "more than"),
    "|pprint of a shared list": (SHARED + "{{ l|pprint|length }}", "more than"),
    "|urlencode of a shared list": (SHARED + "{{ {'a': l}|urlencode|length }}", "more than"),
    "a namespace holding a shared list": (
        "{% set ns = namespace(l=['x' * 100000] * 100000) %}{{ ns }}", "more than"),
    "dict.items of a shared list": (
        "{% set d = dict(a=['x' * 100000] * 100000) %}{{ d.items() }}", "more than"),
    "|batch fill": ("{{ [1]|batch(3000000000, 0)|list|length }}", SEQUENCE),
    "|slice count": ("{{ [1]|slice(3000000000)|list|length }}", SEQUENCE),
    "|sum of lists": ("{% set l = [[1] * 1000] * 1000 %}{{ l|sum(start=[])|length }}", BYTES),
    "|round precision": ("{{ 5|round(-3000000000) }}", NUMBER),
    "|round floor precision": ("{{ 1.5|round(3000000000, 'floor') }}", NUMBER),
    "strftime_now format": ("{{ strftime_now('%c' * 1000000) }}", STRING),
    "exponential macro recursion": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}x", "runs for more than 3 seconds"),
    "a set block of looped text": (
        "{% set x %}" + loops(LOOPED, 100000, 9) + "{% endset %}{{ x|length }}", STRING),
    "a prompt of looped text": (loops(LOOPED, 100000, 9), "prompt of more than"),
    "a block called as self.b()": (
        "{% block b %}" + loops(LOOPED, 100000, 9) + "{% endblock %}{{ self.b()|length }}", STRING),
    "slices kept": (
        "{% set s = 'x' * 1000000 %}{% set ns = namespace(l=[]) %}{% for i in range(2000) %}"
        "{% set ns.l = ns.l + [s[i:]] %}{% endfor %}x", BYTES),
    "split words kept": (
        "{% set s = 'ā ' * 500000 %}{% set ns = namespace(l=[]) %}{% for i in range(200) %}"
        "{% set ns.l = ns.l + [s.split()] %}{% endfor %}x", f"{BYTES}|seconds"),
    "shared lists compared": (
        NS + "{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}"
        "{% endfor %}{{ ns.a == ns.b }}", SEQUENCE),
    "shared tuples hashed": (
        NS + "{% for i in range(60) %}{% set ns.t = (ns.t, ns.t) %}{% endfor %}{{ {ns.t: 1} }}",
        SEQUENCE),
    "shared macro varargs": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1, varargs, varargs) }}{% else %}"
        "{{ {varargs: 1}|length }}{% endif %}{% endmacro %}{{ f(100) }}", SEQUENCE),
    "big constants, computed while compiling": (
        "{{ 'x'|center(1000000) }}" * 2000, "prompt of more than"),
    "a deep list written out": (
        NS + loops("{% set ns.l = [ns.l] %}", 1000, 300) + "{{ ns.l }}", f"{STRING}|seconds"),
}


@pytest.mark.parametrize("source, reason", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_fails_quickly_in_bounded_memory(renderer, source, reason):
    result = renderer.render(source, LONG)
    assert_bounded(result, source)
    assert "error" in result, result
    assert result["error"].startswith("the chat template ") and re.search(reason, result["error"])


def test_a_template_longer_than_any_real_one_is_refused():
    with pytest.raises(ChatTemplateError, match="longer than"):
        ChatTemplate("x" * (MAX_SOURCE_CHARS + 1))


def test_indent_cannot_extend_the_messages():
    """jinja2's indent adds a newline with `+=`, which extends a list in place."""
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="indent takes a string"):
        ChatTemplate("{{ messages|indent }}").render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source, messages, add", [
    ("{% if false %}x{% endif %}", LONG, True),
    ("  \n  ", LONG, True),
    (CHATML, [], False),
])
def test_an_empty_prompt_is_refused(source, messages, add):
    with pytest.raises(ChatTemplateError, match="renders an empty prompt"):
        ChatTemplate(source).render(messages, add_generation_prompt=add)


@pytest.mark.parametrize("source, want", [
    ("{{ 'abc'|truncate(3000000000) }}", "abc"),
    ("{{ (2 ** 64) * (2 ** 64) }}", str(2 ** 128)),
    ("{{ 2.5|round(1000) }}", str(round(2.5, 1000))),
    ("{{ range(100000)|list|length }}", "100000"),
    ("{{ '%5d'|format(3) }}|{{ '%-4s|%.2f' % ('a', 2) }}", f"{3:5d}|{'a':<4s}|{2:.2f}"),
    ("{{ '{:>6}'.format('ab') }}{{ 'x'|center(9) }}", "ab".rjust(6) + "x".center(9)),
    ("{{ 'ab cd'|wordwrap(2) }}", "ab\ncd"),
    ("{{ [1, [2]]|tojson(indent=2) }}", json.dumps([1, [2]], indent=2)),
    ("{% set l = ['ab'] * 1000 %}{{ l|join('-')|length }}", str(len("-".join(["ab"] * 1000)))),
    (doubled("~", 15) + "{{ ns.s|length }}", str(2 << 15)),
])
def test_big_but_bounded_work_renders(source, want):
    assert ChatTemplate(source).render(LONG) == want


def test_limits_grow_with_the_conversation():
    """A conversation longer than the fixed allowance still renders, in full."""
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"{i} " + "word " * 400}
                for i in range(1000)]
    want = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert len(want) > VALUE_CHARS
    assert ChatTemplate(CHATML).render(messages) == want + "<|im_start|>assistant\n"


def test_a_hostile_template_in_a_model_is_refused_by_the_cli(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = doubled("~", 40) + "{{ ns.s }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    p = run_tinyrt("generate", "-m", str(model), "hi", "-n", "2")
    assert_refused(p, "chat template", "more than")


# Random templates: loops, filters and operators on values big and small. Each renders or fails
# with our one line; none hangs or fills memory.


NUMBERS = st.sampled_from(["0", "1", "3", "-7", "80", "5000", "100000", "3000000000", "10 ** 18"])
VALUES = st.sampled_from(["'ab'", "'x' * 1000", "ns.v", "ns.n", "messages", "messages[0].content",
                          "[ns.v, ns.v]", "(ns.v, 1)", "{'k': ns.v}", "range(50)", "lipsum(2)"])
OPERATIONS = [
    "({a}) * {n}", "({a}) ** {n}", "({a}) ~ ({b})", "({a}) + ({b})", "({a}) % ({b})",
    "({a}) == ({b})", "[{a}, {b}] * {n}", "'%0{n}d' % {n}", "'{{:>{n}}}'.format({a})",
    "({a})|center({n})", "({a})|indent({n})", "({a})|wordwrap(({n}) + 1)", "({a})|truncate({n})",
    "({a})|tojson(indent={n})", "lipsum(n={n})", "({a})|join({b})", "({a})|string", "({a})|list",
    "({a})|batch({n}, 0)|list", "({a})|slice({n})|list", "({a})|replace('a', {b})",
    "({a}).ljust({n})", "({a})|format({n})", "({a})|round({n})", "({a})|sum(start=[])",
    "({a})|pprint", "({a})|unique|list", "({a})|sort"]


@st.composite
def expressions(draw, depth=2):
    if depth == 0 or draw(st.booleans()):
        return draw(VALUES | NUMBERS)
    return draw(st.sampled_from(OPERATIONS)).format(
        a=draw(expressions(depth - 1)), b=draw(expressions(depth - 1)), n=draw(NUMBERS))


@st.composite
def statements(draw, depth=2):
    kinds = ["set", "set n", "output"] + (["range", "for"] if depth else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "set":
        return f"{{% set ns.v = {draw(expressions())} %}}"
    if kind == "set n":
        return f"{{% set ns.n = {draw(expressions())} %}}"
    if kind == "output":
        return f"{{{{ {draw(expressions())} }}}}"
    body = "".join(draw(st.lists(statements(depth - 1), min_size=1, max_size=3)))
    if kind == "range":
        times = draw(st.sampled_from(["3", "40", "1000"]))
        return f"{{% for i in range({times}) %}}{body}{{% endfor %}}"
    return f"{{% for c in {draw(expressions(1))} %}}{body}{{% endfor %}}"


@fuzz
@given(body=st.lists(statements(), min_size=1, max_size=4))
def test_random_templates_render_or_fail_in_bounds(renderer, body):
    source = "{% set ns = namespace(v='ab', n=3) %}" + "".join(body) + "."
    result = renderer.render(source, LONG)
    assert_bounded(result, source)
    assert "out of memory" not in result.get("error", ""), result
