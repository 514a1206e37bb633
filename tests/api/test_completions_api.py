"""/v1/completions and logprobs against a fake worker on the real Redis stream: the legacy response shapes (JSON
and SSE), the prompt forms (text used as given, token ids, a list of one), the same admission and tenancy as chat,
clear 400s for what is not supported, and token log-probabilities rendered in both of OpenAI's shapes."""
import json

import pytest

from inference.events import Delta, Done, Usage
from kvserve.chat.models import ChatRequest
from kvserve.chat.tokenizer import tokenizer_get
from tests.api.chat_helpers import sse_events, streaming_body
from tests.api.test_chat_api import assert_error, auth, chat_env, key  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.django_db]
URL = "/v1/completions"


def post(client, raw, body, url=URL):
    return client.post(url, json.dumps(body), content_type="application/json", **auth(raw))


def ids(text: str) -> list[int]:
    return tokenizer_get()[0].encode(text)


def test_a_text_prompt_is_used_as_given_and_answered_in_the_legacy_shape(client, chat_env, key):
    response = post(client, key, {"prompt": "The capital of France is", "max_tokens": 5})
    assert response.status_code == 200, response.content
    body = response.json()
    req = ChatRequest.objects.get()
    assert body["id"] == req.id and req.id.startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "The capital is Paris.", "finish_reason": "stop",
                                "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    ((_, prompt_ids),) = chat_env.calls
    assert prompt_ids == ids("The capital of France is")  # no chat template around it
    assert req.max_tokens == 5 and req.request_params.endpoint == "completions"


@pytest.mark.parametrize("form", ["ids", "list_of_text", "list_of_ids"])
def test_token_ids_and_a_list_of_one_prompt(client, chat_env, key, form):
    prompt = {"ids": ids("Hello there"), "list_of_text": ["Hello there"], "list_of_ids": [ids("Hello there")]}[form]
    assert post(client, key, {"prompt": prompt}).status_code == 200
    ((_, prompt_ids),) = chat_env.calls
    assert prompt_ids == ids("Hello there")
    assert ChatRequest.objects.get().max_tokens == 16  # OpenAI's default for completions


def test_streamed_completion_chunks_and_usage(client, chat_env, key):
    response = post(client, key, {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(streaming_body(response))
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == "The capital is Paris."
    assert events[-3]["choices"][0]["finish_reason"] == "stop" and events[-2]["choices"] == []
    assert events[-2]["usage"]["total_tokens"] == 12 and events[-1] == "[DONE]"


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": ["one", "two"]}, "prompt", "many"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1, 10 ** 9]}, "prompt", "token"),
    ({"prompt": [1, "x"]}, "prompt", "token"),
    ({"prompt": [True]}, "prompt", "token"),
    ({"prompt": {"text": "hi"}}, "prompt", "invalid"),
    ({}, "prompt", "required"),
    ({"prompt": "hi", "n": 9}, "n", "max_value"),
    ({"prompt": "hi", "best_of": 9}, "best_of", "max_value"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of", "invalid"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, "best_of", "unsupported_value"),
    ({"prompt": "hi", "echo": True}, "echo", "unsupported_value"),
    ({"prompt": "hi", "logprobs": 6}, "logprobs", "max_value"),
    ({"prompt": "hi", "suffix": "the end"}, "suffix", "unsupported_value"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", "invalid"),
])
def test_bad_completion_requests_are_clear_400s_and_queue_nothing(client, chat_env, key, body, param, code):
    assert_error(post(client, key, body), 400, code=code, param=param)
    assert not ChatRequest.objects.exists() and not chat_env.calls


def test_empty_text_prompt_and_admission_are_the_chat_services(client, chat_env, key):
    assert_error(post(client, key, {"prompt": ""}), 400, code="empty_prompt", param="prompt")
    error = assert_error(post(client, key, {"prompt": "word " * 5000, "max_tokens": 10}), 400,
                         code="context_length_exceeded", param="prompt")
    assert "4096 tokens" in error["message"] and "in the prompt" in error["message"]
    assert_error(post(client, key, {"prompt": ids("hi"), "max_tokens": 4096}), 400, code="context_length_exceeded")
    assert not ChatRequest.objects.exists() and not chat_env.calls
    assert_error(client.post(URL, "{}", content_type="application/json"), 401, code="missing_api_key")


@pytest.mark.parametrize("body, param, code", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "unsupported_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.name", "required"),
    ({"response_format": "json"}, "response_format", "invalid"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "max_value"),
    ({"logprobs": 1}, "logprobs", "invalid"),
])
def test_chat_response_format_and_logprobs_errors_name_the_parameter(client, chat_env, key, body, param, code):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    assert_error(post(client, key, body, url="/v1/chat/completions"), 400, code=code, param=param)
    assert not chat_env.calls


def test_plain_text_response_format_is_accepted(client, chat_env, key):
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"}}
    assert post(client, key, body, url="/v1/chat/completions").status_code == 200


# ---- logprobs: the workers' entries in OpenAI's two shapes -----------------------------------------

def logprob_events():
    tk = tokenizer_get()[0]
    paris, dot, alt = tk.encode(" Paris")[0], tk.encode(".")[0], tk.encode(" Lyon")[0]
    eos = tk.eos_ids[0]
    return [Delta(" Paris", [[paris, -0.25, [[paris, -0.25], [alt, -2.5]]]]),
            Delta(".", [[dot, -0.5, [[dot, -0.5], [paris, -3.0]]]]),
            Delta("", [[eos, -0.1, [[eos, -0.1], [dot, -4.0]]]]),
            Done("stop", Usage(7, 3))]


def test_chat_logprobs_in_openai_shape(client, chat_env, key):
    chat_env.events = logprob_events()
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    choice = post(client, key, body, url="/v1/chat/completions").json()["choices"][0]
    assert ChatRequest.objects.get().request_params.sampling.logprobs == 1  # what the engine is asked for
    assert choice["message"]["content"] == " Paris."
    assert choice["logprobs"] == {"refusal": None, "content": [  # every token, the end-of-sequence one (no text) too
        {"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris"),
         "top_logprobs": [{"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris")}]},
        {"token": ".", "logprob": -0.5, "bytes": [46],
         "top_logprobs": [{"token": ".", "logprob": -0.5, "bytes": [46]}]},
        {"token": "", "logprob": -0.1, "bytes": [], "top_logprobs": [{"token": "", "logprob": -0.1, "bytes": []}]}]}
    assert len(choice["logprobs"]["content"]) == 3  # == usage.completion_tokens of the events
    streamed = sse_events(streaming_body(post(client, key, {**body, "stream": True}, url="/v1/chat/completions")))
    content = [c for e in streamed[:-1] for ch in e["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]]
    assert content == choice["logprobs"]["content"]


def test_completion_logprobs_in_the_legacy_shape(client, chat_env, key):
    chat_env.events = logprob_events()
    choice = post(client, key, {"prompt": "The capital of France is", "logprobs": 2}).json()["choices"][0]
    assert choice["text"] == " Paris."
    assert choice["logprobs"] == {"tokens": [" Paris", ".", ""], "token_logprobs": [-0.25, -0.5, -0.1],
                                  "top_logprobs": [{" Paris": -0.25, " Lyon": -2.5}, {".": -0.5, " Paris": -3.0},
                                                   {"": -0.1, ".": -4.0}],
                                  "text_offset": [0, 6, 7]}
    assert len(choice["logprobs"]["tokens"]) == 3  # == usage.completion_tokens of the events
    streamed = sse_events(streaming_body(post(client, key, {"prompt": "x", "logprobs": 0, "stream": True})))
    parts = [ch["logprobs"] for e in streamed[:-1] for ch in e["choices"] if ch["logprobs"]]
    assert [p["tokens"] for p in parts] == [[" Paris"], ["."], [""]]
    assert [p["text_offset"] for p in parts] == [[0], [6], [7]] and parts[0]["top_logprobs"] == [{}]
