"""The request surface on a real stack (real workers, the real model, uvicorn): /tokenize counts what the answer's
usage.prompt_tokens counts, streamed usage on every chunk (continuous_usage_stats) counts every generated token, and
the `openai` client's refused and unknown fields come back as 400s naming them."""
import json

import openai
import pytest

from tests.e2e.test_chat_api import client, http, model_id  # noqa: F401  (fixtures)

MESSAGES = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]


def test_tokenize_count_is_the_answers_prompt_tokens(stack, client, model_id):
    status, _, raw = http(stack, "POST", "/tokenize", {"model": model_id, "messages": MESSAGES})
    assert status == 200, raw
    body = json.loads(raw)
    reply = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4)
    assert body["count"] == reply.usage.prompt_tokens == len(body["tokens"]) and body["max_model_len"] > 0
    status, _, raw = http(stack, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and "Name a colour." in json.loads(raw)["prompt"]
    status, _, raw = http(stack, "GET", "/version")
    assert status == 200 and json.loads(raw)["version"]


def test_continuous_usage_stats_counts_every_token(client, model_id):
    chunks = list(client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Count from one to ten."}], max_tokens=12, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and len(set(counts)) > 3
    final = chunks[-1].usage
    assert chunks[-2].usage == final and final.completion_tokens == 12  # max_tokens: cut by length
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_the_openai_clients_refused_and_unknown_fields_are_400s(client, model_id):
    for extra, param in (({"top_logprobs": None, "store": True}, "store"), ({"max_token": 5}, "max_token"),
                         ({"structural_tag": "{}"}, "structural_tag")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=2, extra_body=extra)
        assert exc.value.body["param"] == param, exc.value.body
