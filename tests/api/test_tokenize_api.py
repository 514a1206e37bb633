"""vLLM's /tokenize, /detokenize and /version: vLLM's shapes, the chat API's own rendering and tokenization (the
count is what admission counts for the same messages), clear 400s, the chat API's auth and throttling."""
import json

import pytest

from kvserve.chat.models import ChatRequest
from kvserve.chat.tokenizer import tokenizer_get
from tests.api.test_chat_api import assert_error, auth, chat_env, key  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.django_db]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def post(client, raw, url, body):
    return client.post(url, json.dumps(body), content_type="application/json", **auth(raw))


def test_tokenize_messages_gives_exactly_the_prompt_a_chat_request_is_admitted_with(client, chat_env, key):
    body = post(client, key, "/tokenize", {"messages": MESSAGES}).json()
    assert post(client, key, "/v1/chat/completions", {"messages": MESSAGES}).status_code == 200
    ((_, prompt_ids),) = chat_env.calls
    assert body["tokens"] == prompt_ids and body["count"] == len(prompt_ids) == ChatRequest.objects.get().prompt_tokens
    assert body["max_model_len"] == 8192 and body["token_strs"] is None  # the live workers' window
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}


def test_tokenize_a_prompt_is_the_completions_tokenization(client, chat_env, key):
    body = post(client, key, "/tokenize", {"prompt": "The capital of France is", "return_token_strs": True,
                                           "model": "SmolLM2-135M-Instruct", "add_special_tokens": True}).json()
    assert post(client, key, "/v1/completions", {"prompt": "The capital of France is"}).status_code == 200
    ((_, prompt_ids),) = chat_env.calls
    assert body["tokens"] == prompt_ids and body["count"] == len(prompt_ids)
    tokenizer = tokenizer_get()[0].tokenizer
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in prompt_ids] and body["token_strs"][1] == "Ġcapital"


def test_without_the_generation_prompt_the_messages_end_sooner(client, chat_env, key):
    full = post(client, key, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    bare = post(client, key, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert len(bare) < len(full) and full[:len(bare)] == bare
    assert tokenizer_get()[0].decode(full[len(bare):]).strip() == "assistant"


@pytest.mark.parametrize("body, param, code", [
    ({}, "prompt", "invalid"),
    ({"prompt": "a", "messages": MESSAGES}, "prompt", "invalid"),
    ({"prompt": 5}, "prompt", "invalid"),
    ({"messages": []}, "messages", "empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "invalid_choice"),
    ({"prompt": "a", "tools": []}, "tools", "unknown_parameter"),
    ({"prompt": "a", "add_special_tokens": False}, "add_special_tokens", "unsupported_value"),
    ({"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens", "unsupported_value"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message", "unsupported_value"),
    ({"prompt": "a", "return_token_strs": "yes"}, "return_token_strs", "invalid"),
])
def test_bad_tokenize_requests_are_400s_naming_the_field(client, chat_env, key, body, param, code):
    assert_error(post(client, key, "/tokenize", body), 400, code=code, param=param)


def test_another_model_is_a_404(client, chat_env, key):
    assert_error(post(client, key, "/tokenize", {"prompt": "a", "model": "gpt-4o"}), 404, code="model_not_found")
    assert_error(post(client, key, "/detokenize", {"tokens": [1], "model": "gpt-4o"}), 404, code="model_not_found")


def test_detokenize_round_trips_and_keeps_special_tokens(client, chat_env, key):
    tokens = post(client, key, "/tokenize", {"prompt": "Hello, world!"}).json()["tokens"]
    assert post(client, key, "/detokenize", {"tokens": tokens}).json() == {"prompt": "Hello, world!"}
    chat = post(client, key, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    text = post(client, key, "/detokenize", {"tokens": chat}).json()["prompt"]
    assert text == tokenizer_get()[0].render_chat(MESSAGES) and "<|im_start|>" in text
    assert post(client, key, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tokens", [[1, 10 ** 9], [-1], [True], ["1"], "1 2", None])
def test_an_id_outside_the_vocabulary_is_a_400_naming_tokens(client, chat_env, key, tokens):
    assert_error(post(client, key, "/detokenize", {"tokens": tokens}), 400, param="tokens")


def test_version(client, chat_env, key, settings):
    assert client.get("/version", **auth(key)).json() == {"version": settings.KVSERVE_VERSION}


@pytest.mark.parametrize("method, url", [("post", "/tokenize"), ("post", "/detokenize"), ("get", "/version")])
def test_each_needs_a_key_and_is_throttled_per_key_with_the_chat_api(client, chat_env, key, settings, method, url):
    assert_error(getattr(client, method)(url), 401, code="missing_api_key")
    settings.KVSERVE_THROTTLE_RATE = "2/min"
    assert client.get("/v1/models", **auth(key)).status_code == 200
    body = {"/tokenize": {"prompt": "a"}, "/detokenize": {"tokens": [1]}}.get(url)
    call = (lambda: post(client, key, url, body)) if method == "post" else (lambda: client.get(url, **auth(key)))
    assert call().status_code == 200
    assert_error(call(), 429, code="throttled")  # the third call of this key, whichever endpoint


def test_the_schema_describes_them(client):
    paths = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    assert {"/tokenize", "/detokenize", "/version"} <= set(paths)
    assert paths["/tokenize"]["post"]["security"] == [{"ApiKeyAuth": []}]
