"""n and best_of on a real stack (Celery prefill + decode workers with the real model): one prefill, the choices
forked on the decode worker, n choices by index, the prompt counted once, streamed choices naming their index."""
import json

import openai
import pytest

from tests.e2e.test_chat_api import http

QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=240)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_n_choices_at_temperature_1_with_a_seed(client, model_id):
    kw = dict(model=model_id, messages=QUESTION, max_tokens=12, temperature=1, seed=11)
    one = client.chat.completions.create(**kw)
    three = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == one.choices[0].message.content  # choice 0: the request's seed
    assert len({c.message.content for c in three.choices}) > 1
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # prefilled once, counted once
    assert three.usage.completion_tokens > one.usage.completion_tokens
    streamed = client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw)
    text, finish, usage = {}, {}, None
    for chunk in streamed:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert text == {c.index: c.message.content for c in three.choices}
    assert finish == {c.index: c.finish_reason for c in three.choices}
    assert usage.prompt_tokens == one.usage.prompt_tokens


def test_best_of_3_returns_one_choice(stack, client, model_id):
    r = client.completions.create(model=model_id, prompt="The sky is", max_tokens=8, temperature=1, seed=3,
                                  best_of=3, n=1)
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].text
    status, _, raw = http(stack, "POST", "/v1/completions", {"prompt": "x", "best_of": 3, "stream": True})
    assert status == 400 and json.loads(raw)["error"]["param"] == "best_of"
