"""Talk to `tinyrt serve` with the official OpenAI client (`pip install openai`): a streamed
reply, then a follow-up turn, which the server prefills from its first new token.

    tinyrt serve &                  # the default model at http://127.0.0.1:8080/v1
    python examples/openai_client.py
"""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": "Name three rivers in Europe."}]
for question in (None, "Which of them is the longest?"):
    if question:
        messages.append({"role": "user", "content": question})
    reply = []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=128,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            reply.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            u = chunk.usage
            print(f"\n[{u.prompt_tokens} prompt tokens, {u.prompt_tokens_details.cached_tokens} "
                  f"of them reused from the cache; {u.completion_tokens} generated]")
    messages.append({"role": "assistant", "content": "".join(reply)})
