"""n and best_of on both endpoints against a fake worker on the real Redis stream: the fields reach the request
row, one stream's deltas by choice index become n choices (JSON ordered, SSE chunks naming their index), the
prompt is counted once, best_of's Done order is the answer's, and admission counts every choice's tokens."""
import json

import pytest

from inference.events import ChoiceEnd, Delta, Done, Usage
from kvserve.chat.models import ChatRequest
from tests.api.chat_helpers import sse_events, streaming_body
from tests.api.test_chat_api import MESSAGES, assert_error, auth, chat_env, key  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.django_db]

THREE = [Delta("Par"), Delta("Lyo", index=1), Delta("Nic", index=2), Delta("is.", index=0), Delta("n.", index=1),
         Delta("e.", index=2),
         Done("stop", Usage(7, 9), (ChoiceEnd(0, "stop", 3), ChoiceEnd(1, "length", 3), ChoiceEnd(2, "stop", 3)))]


def post(client, raw, body, url="/v1/chat/completions"):
    return client.post(url, json.dumps(body), content_type="application/json", **auth(raw))


def test_chat_n_returns_every_choice_by_index_with_the_prompt_counted_once(client, chat_env, key):
    chat_env.events = THREE
    response = post(client, key, {"messages": MESSAGES, "n": 3, "temperature": 1, "seed": 5})
    assert response.status_code == 200, response.content
    body = response.json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Paris.", "stop"), (1, "Lyon.", "length"), (2, "Nice.", "stop")]
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 9
    req = ChatRequest.objects.get()
    assert (req.request_params.n, req.request_params.num_sequences) == (3, 3) and req.params["n"] == 3


def test_streamed_choices_carry_their_index_and_each_finishes(client, chat_env, key):
    chat_env.events = THREE
    response = post(client, key, {"messages": MESSAGES, "n": 3, "stream": True,
                                  "stream_options": {"include_usage": True}})
    events = [e for e in sse_events(streaming_body(response)) if e != "[DONE]"]
    roles = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
    assert roles == [0, 1, 2]
    text = {i: "".join(e["choices"][0]["delta"].get("content", "") for e in events
                       if e["choices"] and e["choices"][0]["index"] == i) for i in range(3)}
    assert text == {0: "Paris.", 1: "Lyon.", 2: "Nice."}
    finishes = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events
                if e["choices"] and e["choices"][0]["finish_reason"]}
    assert finishes == {0: "stop", 1: "length", 2: "stop"}
    assert events[-1]["usage"]["prompt_tokens"] == 7 and events[-1]["usage"]["completion_tokens"] == 9


def test_completions_best_of_returns_the_done_order_reindexed(client, chat_env, key):
    chat_env.events = [Delta("a", index=0), Delta("b", index=1), Delta("c", index=2),
                       Done("length", Usage(4, 4), (ChoiceEnd(2, "length", 2, -0.5), ChoiceEnd(0, "stop", 2, -1.0)))]
    response = post(client, key, {"prompt": "x", "n": 2, "best_of": 3}, url="/v1/completions")
    assert response.status_code == 200, response.content
    body = response.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "c", "length"),
                                                                                       (1, "a", "stop")]
    assert body["usage"]["completion_tokens"] == 4  # the returned choices' tokens
    params = ChatRequest.objects.get().request_params
    assert (params.n, params.best_of, params.ranked, params.endpoint) == (2, 3, True, "completions")


def test_chat_best_of_is_honoured_too(client, chat_env, key):
    chat_env.events = [Delta("a"), Delta("b", index=1), Done("stop", Usage(4, 1), (ChoiceEnd(1, "stop", 1, -0.1),))]
    body = post(client, key, {"messages": MESSAGES, "best_of": 2}).json()
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "b")]


def test_admission_counts_every_choices_tokens(client, chat_env, key):
    # the live limit is 4096: one choice of 1500 fits, three do not (the prompt once + 3 x 1500)
    assert post(client, key, {"messages": MESSAGES, "max_tokens": 1500}).status_code == 200
    error = assert_error(post(client, key, {"messages": MESSAGES, "max_tokens": 1500, "n": 3}), 400,
                         code="context_length_exceeded", param="messages")
    assert "4500 in the completion" in error["message"]
    assert_error(post(client, key, {"prompt": "x", "max_tokens": 1500, "n": 1, "best_of": 3}, url="/v1/completions"),
                 400, code="context_length_exceeded", param="prompt")
    assert ChatRequest.objects.count() == 1


def test_completions_n_streams_each_choice_with_its_index(client, chat_env, key):
    chat_env.events = [Delta("a"), Delta("b", index=1), Delta("c", index=1),
                       Done("stop", Usage(4, 3), (ChoiceEnd(0, "stop", 1), ChoiceEnd(1, "length", 2)))]
    response = post(client, key, {"prompt": "x", "n": 2, "stream": True}, url="/v1/completions")
    events = [e for e in sse_events(streaming_body(response)) if e != "[DONE]"]
    assert [(e["choices"][0]["index"], e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events] == [
        (0, "a", None), (1, "b", None), (1, "c", None), (0, "", "stop"), (1, "", "length")]
    assert ChatRequest.objects.get().request_params.n == 2
