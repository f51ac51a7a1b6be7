import pytest

from helpers import CHATML
from tinyrt.chat_template import ChatTemplate, ChatTemplateError, template_from_config

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
    ("{{ 'x' * 1000000000 }}", "sequence"),
    ("{{ messages * 2000000 }}", "sequence"),
    ("{{ 2 ** 100000000 }}", "power"),
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
