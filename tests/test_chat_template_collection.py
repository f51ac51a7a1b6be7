"""llama.cpp's collection of real chat templates (models/templates/ of its repository, from the
llama-cpp-python sdist): every conversation that transformers renders with one of them, tinyrt's
bounded sandbox renders to the same text."""


from llama_cpp_files import llama_cpp_dir
from tinyrt.chat_template import ChatTemplate

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You answer in one line."},
     {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about \"quotes\" & <tags>."}],
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def test_the_template_collection_renders_as_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    templates = sorted((llama_cpp_dir() / "models" / "templates").glob("*.jinja"))
    assert len(templates) >= 70
    compared, wrong = 0, []
    for path in templates:
        source = path.read_text(encoding="utf-8")
        for messages in CONVERSATIONS:
            try:
                want = render_jinja_template([messages], chat_template=source,
                                             add_generation_prompt=True, **SPECIAL)[0][0]
            except Exception:             # (a template that refuses this conversation)
                continue
            compared += 1
            try:
                got = ChatTemplate(source, **SPECIAL).render(messages)
            except Exception as e:
                wrong.append((path.name, f"{type(e).__name__}: {e}"))
                continue
            if got != want:
                wrong.append((path.name, got[:200], want[:200]))
    assert compared >= 150, compared
    assert not wrong, f"{len(wrong)} of {compared} differ: {wrong[:3]}"
