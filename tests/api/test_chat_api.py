"""The chat API against a fake worker: OpenAI response shapes (JSON and SSE), admission, bad input (always a
clear 4xx), worker failures (503, never a 200 with content), throttling, tenant isolation, the schema."""
import hashlib
import hmac
import json

import pytest
from django.db import transaction

from inference.events import Delta, Error
from inference.params import RequestParams, Sampling
from kvserve.celery import app
from kvserve.chat import services
from kvserve.chat.models import ChatRequest
from kvserve.chat.selectors import model_get
from kvserve.chat.tokenizer import tokenizer_get
from kvserve.tenants.models import Tenant
from kvserve.tenants.services import api_key_create
from tests.api.chat_helpers import FakeWorker, sse_events, streaming_body
from tests.conftest import TEST_REDIS_URL

pytestmark = [
    pytest.mark.django_db,
]

URL = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def chat_env(registry_settings, registry, make_worker, registry_redis, registry_prefix, monkeypatch):
    """Live prefill + decode registrations (limit 4096), the throttle cache on the test Redis under this
    test's prefix, and a fake worker behind the prefill the services send (on_commit runs at once, as in
    autocommit)."""
    registry_settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                            "LOCATION": TEST_REDIS_URL, "KEY_PREFIX": f"{registry_prefix}:cache"}}
    registry_settings.KVSERVE_THROTTLE_RATE = "1000/min"
    registry.register(make_worker("prefill", worker_id="p1", capacity_tokens=4096, window=8192))
    registry.register(make_worker("decode", worker_id="d1", capacity_tokens=8192, window=8192))
    worker = FakeWorker(registry_redis, registry_prefix)
    monkeypatch.setattr(app, "send_task", worker.send_task)
    monkeypatch.setattr(transaction, "on_commit", lambda fn, using=None, robust=False: fn())
    return worker


@pytest.fixture
def key():
    return api_key_create("acme")[1]


def auth(raw):
    return {"HTTP_AUTHORIZATION": f"Bearer {raw}"}


def post(client, raw, body, **extra):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(URL, data, content_type="application/json", **auth(raw), **extra)


def assert_error(response, status, code=None, param=None):
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- success: shapes ---------------------------------------------------------------------------

def test_non_stream_completion_is_openai_shaped(client, chat_env, key):
    response = post(client, key, {"model": model_get()["id"], "messages": MESSAGES, "max_tokens": 16})
    assert response.status_code == 200, response.content
    body = response.json()
    req = ChatRequest.objects.get()
    assert body["id"] == req.id and body["object"] == "chat.completion" and body["model"] == model_get()["id"]
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "The capital is Paris."},
                                "finish_reason": "stop", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert isinstance(body["created"], int)
    assert [c[0] for c in chat_env.calls] == [req.id] and req.max_tokens == 16


def test_content_parts_fields_at_their_defaults_and_defaults(client, chat_env, key):
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                         {"role": "assistant", "content": "Hello."},
                         {"role": "user", "content": "Capital of France?", "name": "bob"}],
            "tools": [], "logprobs": True, "tool_choice": None, "n": 1, "user": "u-1", "presence_penalty": 0}
    response = post(client, key, body)
    assert response.status_code == 200, response.content
    req = ChatRequest.objects.get()
    params = req.request_params
    assert req.max_tokens == 256 and params.sampling.seed is not None  # default max_tokens; a seed fixed at entry
    assert params.sampling.temperature is None  # the engine default: greedy
    assert (params.user, params.sampling.logprobs, params.endpoint) == ("u-1", 0, "chat")


def test_sampling_parameters_reach_the_request(client, chat_env, key):
    response = post(client, key, {"messages": MESSAGES, "max_completion_tokens": 9, "temperature": 0.7,
                                  "top_p": 0.9, "seed": -5, "stop": "\n"})
    assert response.status_code == 200, response.content
    req = ChatRequest.objects.get()
    assert req.max_tokens == 9
    assert req.request_params == RequestParams(Sampling(temperature=0.7, top_p=0.9, seed=-5, stop=("\n",)))
    assert req.params == {"v": 1, "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": -5, "stop": ["\n"]},
                          "endpoint": "chat"}  # versioned, who asked apart from how to sample


def test_max_completion_tokens_wins_over_max_tokens(client, chat_env, key):
    assert post(client, key, {"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 7}).status_code == 200
    assert ChatRequest.objects.get().max_tokens == 7


@pytest.mark.parametrize("temperature,top_p", [(5e-324, 0.5), (2.0, 5e-324), (1e-300, 1e-300), (1e-8, 1e-6)])
def test_extreme_sampling_values_are_normalized_to_what_the_engine_can_sample(client, chat_env, key, temperature,
                                                                              top_p):
    """Found by schemathesis: temperature 2 with top_p 5e-324 underflowed in float32 and failed the engine."""
    import torch

    from inference.sampling import sample
    from kvserve.chat.services import sampling_params

    response = post(client, key, {"messages": MESSAGES, "temperature": temperature, "top_p": top_p, "seed": 1})
    assert response.status_code == 200, response.content
    req = ChatRequest.objects.get()
    sampling = req.request_params.sampling
    assert sampling.temperature in (0.0, temperature) and sampling.top_p >= 1e-6
    logits = torch.randn(1, 49152) * 20
    assert sample(logits, [sampling_params(req)], [0]) == [int(logits.argmax())]


def test_stream_is_openai_chunks_with_usage_and_done(client, chat_env, key):
    response = post(client, key, {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response["Content-Type"].startswith("text/event-stream")
    events = sse_events(streaming_body(response))
    req = ChatRequest.objects.get()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == req.id and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "The capital is Paris."
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 12


def test_stream_without_usage_has_no_usage_chunk(client, chat_env, key):
    events = sse_events(streaming_body(post(client, key, {"messages": MESSAGES, "stream": True})))
    assert events[-1] == "[DONE]" and all(e == "[DONE]" or e["choices"] for e in events)


# ---- worker-side failures ----------------------------------------------------------------------

@pytest.mark.parametrize("code", ["handoff_refused", "kv_isolation_violation", "worker_lost", "engine_error"])
def test_worker_failure_is_503_never_200(client, chat_env, key, code):
    chat_env.events = [Delta("leaked?"), Error(code, "failed closed")]
    response = post(client, key, {"messages": MESSAGES})
    error = assert_error(response, 503, code=code)
    assert error["type"] == "server_error" and b"leaked?" not in response.content


def test_worker_failure_in_stream_is_an_error_event_then_done(client, chat_env, key):
    chat_env.events = [Error("handoff_refused", "decode refused the handoff")]
    events = sse_events(streaming_body(post(client, key, {"messages": MESSAGES, "stream": True})))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "handoff_refused" and events[-2]["error"]["type"] == "server_error"
    assert not any("choices" in e and e["choices"][0].get("finish_reason") for e in events[:-1])


def test_worker_side_admission_rejection_is_400(client, chat_env, key):
    chat_env.events = [Error("context_length_exceeded", "too long for this worker")]
    assert_error(post(client, key, {"messages": MESSAGES}), 400, code="context_length_exceeded", param="messages")


def test_no_output_in_time_is_503_timeout(client, chat_env, key, settings):
    settings.KVSERVE_RESPONSE_TIMEOUT_S = 1
    chat_env.events = []
    assert_error(post(client, key, {"messages": MESSAGES}), 503, code="timeout")
    events = sse_events(streaming_body(post(client, key, {"messages": MESSAGES, "stream": True})))
    assert events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]"


def _publish_later(worker, delay_s):
    """Makes the fake worker answer `delay_s` after the request is queued, from another thread."""
    import threading

    events, worker.events = worker.events, []
    original = worker.delay

    def delay(request_id, prompt_ids):
        original(request_id, prompt_ids)
        threading.Timer(delay_s, lambda: worker.outputs.publish_many([(request_id, e) for e in events])).start()

    worker.delay = delay


def test_a_wait_longer_than_redis_socket_timeout_still_answers(client, chat_env, key):
    """redis-py's default socket timeout is 5 s; a blocking read for a slow answer must outlast it."""
    _publish_later(chat_env, 5.5)
    response = post(client, key, {"messages": MESSAGES})
    assert response.status_code == 200, response.content
    assert response.json()["choices"][0]["message"]["content"] == "The capital is Paris."


def test_stream_sends_keepalives_while_waiting(client, chat_env, key, settings):
    settings.KVSERVE_SSE_KEEPALIVE_S = 1
    _publish_later(chat_env, 2.5)
    raw = streaming_body(post(client, key, {"messages": MESSAGES, "stream": True}))
    assert b": keep-alive\n\n" in raw
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"


# ---- admission -------------------------------------------------------------------------------

def test_overlong_request_is_400_with_numbers_and_nothing_queued(client, chat_env, key):
    response = post(client, key, {"messages": MESSAGES, "max_tokens": 4090})
    error = assert_error(response, 400, code="context_length_exceeded", param="messages")
    prompt_tokens = len(tokenizer_get()[0].encode_chat(MESSAGES))
    assert "4096" in error["message"] and str(prompt_tokens + 4090) in error["message"]
    assert str(prompt_tokens) in error["message"] and "4090" in error["message"]
    assert ChatRequest.objects.count() == 0 and chat_env.calls == []


def test_the_served_vocabulary_bounds_characters_per_token():
    tokenizer = tokenizer_get()[0]
    assert tokenizer.max_token_chars == 81  # SmolLM2: a newline and 80 spaces; no token covers more
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    assert max(len(tokenizer.tokenizer.decode([i], skip_special_tokens=False)) for i in vocab.values()) <= 81


def test_a_1_mb_prompt_is_refused_without_being_tokenized(client, chat_env, key, settings):
    settings.KVSERVE_MAX_BODY_BYTES = 2 * 2**20
    before = services.prompts_tokenized()
    response = post(client, key, {"messages": [{"role": "user", "content": "x" * 2**20}], "max_tokens": 16})
    error = assert_error(response, 400, code="context_length_exceeded", param="messages")
    assert "4096" in error["message"] and "characters" in error["message"] and "81" in error["message"]
    assert services.prompts_tokenized() == before  # the cheap bound answered; the tokenizer never ran
    assert ChatRequest.objects.count() == 0 and chat_env.calls == []
    # under the bound it is tokenized, and the token count decides
    response = post(client, key, {"messages": [{"role": "user", "content": "x " * 40_000}], "max_tokens": 16})
    error = assert_error(response, 400, code="context_length_exceeded")
    assert "characters" not in error["message"] and services.prompts_tokenized() == before + 1


def test_prompt_hash_is_keyed_by_the_deployment_secret(client, chat_env, key, settings):
    prompt = tokenizer_get()[0].render_chat(MESSAGES)
    first = ChatRequest.objects.get(id=post(client, key, OK).json()["id"])
    assert first.prompt_hash == hmac.new(settings.KVSERVE_PROMPT_HASH_KEY.encode(), prompt.encode(),
                                         hashlib.sha256).hexdigest()
    assert first.prompt_hash != hashlib.sha256(prompt.encode()).hexdigest()  # no dictionary attack on it
    assert ChatRequest.objects.get(id=post(client, key, OK).json()["id"]).prompt_hash == first.prompt_hash
    settings.KVSERVE_PROMPT_HASH_KEY = "another-deployment"
    assert ChatRequest.objects.get(id=post(client, key, OK).json()["id"]).prompt_hash != first.prompt_hash


@pytest.mark.parametrize("store_text", [False, True])
def test_stream_retention_follows_store_text(client, chat_env, registry_redis, settings, store_text):
    from kvserve.workers import outputs_get

    settings.KVSERVE_STREAM_REPLAY_S, settings.KVSERVE_STREAM_RETENTION_S = 45, 3000
    api_key, raw = api_key_create("retained" if store_text else "private")
    Tenant.objects.filter(pk=api_key.tenant_id).update(store_text=store_text)
    done = post(client, raw, OK).json()["id"]  # the fake worker publishes deltas and done, as decode does
    chat_env.events = [Delta("partial")]
    post(client, raw, {**OK, "stream": True})  # a stream: answered before the request ends
    failed = ChatRequest.objects.get(id=chat_env.calls[-1][0])
    services.chat_request_fail(failed, code="worker_lost", message="gone")  # a final event from the web side
    for request_id in (done, failed.id):
        ttl = registry_redis.ttl(outputs_get().key(request_id))
        assert (2900 < ttl <= 3000) if store_text else (0 < ttl <= 45), (request_id, ttl)


def test_no_live_workers_is_503(client, chat_env, key, registry, request_log):
    registry.unregister("d1")
    assert_error(post(client, key, {"messages": MESSAGES}), 503, code="no_workers")
    assert ChatRequest.objects.count() == 0 and chat_env.calls == []
    assert [r.levelname for r in request_log] == ["WARNING"]  # expected while a stack starts: no ERROR


def test_unreachable_redis_is_503_not_500(client, chat_env, key, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    error = assert_error(post(client, key, {"messages": MESSAGES}), 503, code="backend_unavailable")
    assert error["type"] == "server_error"


def test_chat_template_refusal_is_400(client, chat_env, key, monkeypatch):
    import jinja2

    from kvserve.chat import services

    class Refusing:
        def render_chat(self, messages, add_generation_prompt=True):
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant")

    monkeypatch.setattr(services, "tokenizer_get", lambda: (Refusing(), "fp", model_get()["id"]))
    assert_error(post(client, key, {"messages": MESSAGES}), 400, code="invalid_messages", param="messages")


# ---- bad input: a clear 4xx, nothing created ---------------------------------------------------

OK = {"messages": MESSAGES}
BAD_BODIES = [
    ({}, "messages", "required"),
    ({"messages": []}, "messages", "empty"),
    ({"messages": "hi"}, "messages", "not_a_list"),
    ({"messages": None}, "messages", "null"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role", "invalid_choice"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages.0.role", "invalid_choice"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages.0.role", "invalid_choice"),
    ({"messages": [{"content": "x"}]}, "messages.0.role", "required"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "null"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content", "empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "part"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages.0.content", "part"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content", "surrogates"),
    ({"messages": [MESSAGES[0], {"role": "robot", "content": "x"}]}, "messages.1.role", "invalid_choice"),
    ({"messages": ["hello"]}, "messages.0", "invalid"),
    ({**OK, "max_tokens": 0}, "max_tokens", "min_value"),
    ({**OK, "max_tokens": -1}, "max_tokens", "min_value"),
    ({**OK, "max_tokens": 10**12}, "max_tokens", "max_value"),
    ({**OK, "max_tokens": 8193}, "max_tokens", "max_value"),
    ({**OK, "max_tokens": "5"}, "max_tokens", "invalid"),
    ({**OK, "max_tokens": 5.5}, "max_tokens", "invalid"),
    ({**OK, "max_tokens": True}, "max_tokens", "invalid"),
    ({**OK, "max_completion_tokens": 0}, "max_completion_tokens", "min_value"),
    ({**OK, "temperature": -0.1}, "temperature", "min_value"),
    ({**OK, "temperature": 2.5}, "temperature", "max_value"),
    ({**OK, "temperature": "1"}, "temperature", "invalid"),
    ({**OK, "top_p": 0}, "top_p", "min_value"),
    ({**OK, "top_p": 1.5}, "top_p", "max_value"),
    ({**OK, "seed": "7"}, "seed", "invalid"),
    ({**OK, "seed": 2**64}, "seed", "max_value"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "too_many"),
    ({**OK, "stop": [""]}, "stop", "blank"),
    ({**OK, "stop": 5}, "stop", "invalid"),
    ({**OK, "stop": ["a", 1]}, "stop", "invalid"),
    ({**OK, "stream": "yes"}, "stream", "invalid"),
    ({**OK, "stream": 1}, "stream", "invalid"),
    ({**OK, "stream_options": "x"}, "stream_options", "invalid"),
    ({**OK, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage", "invalid"),
    ({**OK, "n": 9}, "n", "max_value"),
    ({**OK, "n": 0}, "n", "min_value"),
    ({**OK, "best_of": 9}, "best_of", "max_value"),
    ({**OK, "n": 3, "best_of": 2}, "best_of", "invalid"),
    ({**OK, "n": 1, "best_of": 2, "stream": True}, "best_of", "unsupported_value"),
    ({**OK, "user": 5}, "user", "invalid"),
    ({**OK, "model": 5}, "model", "invalid"),
    ([OK], None, "invalid"),
    ("just a string", None, "invalid"),
]


@pytest.mark.parametrize("body,param,code", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_input_is_400_naming_the_param(client, chat_env, key, body, param, code):
    response = post(client, key, json.dumps(body))
    error = assert_error(response, 400, code=code, param=param)
    assert error["type"] == "invalid_request_error"
    assert ChatRequest.objects.count() == 0 and chat_env.calls == []


def test_n_above_the_bound_says_so(client, chat_env, key):
    error = assert_error(post(client, key, {**OK, "n": 9}), 400, param="n")
    assert "less than or equal to 8" in error["message"]


def test_unknown_model_is_404(client, chat_env, key):
    assert_error(post(client, key, {**OK, "model": "gpt-4o"}), 404, code="model_not_found", param="model")


@pytest.mark.parametrize("raw,fragment", [
    (b"{nope", "not valid JSON"),
    (b'{"messages": [', "not valid JSON"),
    (b'{"messages": NaN}', "not valid JSON"),
    (b"\xff\xfe{}", "not valid UTF-8"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
])
def test_unparseable_body_is_400(client, chat_env, key, raw, fragment):
    error = assert_error(post(client, key, raw), 400, code="parse_error")
    assert fragment in error["message"]
    assert ChatRequest.objects.count() == 0


def test_empty_body_is_400(client, chat_env, key):
    assert_error(post(client, key, b""), 400, param="messages", code="required")


def test_wrong_content_type_is_415(client, chat_env, key):
    response = client.post(URL, "messages=x", content_type="application/x-www-form-urlencoded", **auth(key))
    assert_error(response, 415, code="unsupported_media_type")


def test_body_over_the_limit_is_413(client, chat_env, key, settings):
    big = {"messages": [{"role": "user", "content": "x" * (1024 * 1024)}]}
    error = assert_error(post(client, key, big), 413, code="request_too_large")
    assert str(1024 * 1024) in error["message"]
    settings.KVSERVE_MAX_BODY_BYTES = 200
    assert_error(post(client, key, {"messages": [{"role": "user", "content": "y" * 300}]}), 413)
    assert post(client, key, {"messages": [{"role": "user", "content": "y" * 10}]}).status_code == 200
    assert ChatRequest.objects.count() == 1


def test_30_mb_body_is_413_not_500(client, chat_env, key):
    # over Django's own DATA_UPLOAD_MAX_MEMORY_SIZE too: it used to raise RequestDataTooBig -> 500
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (30 * 2**20)}]})
    error = assert_error(post(client, key, big), 413, code="request_too_large")
    assert "KVSERVE_MAX_BODY_BYTES" in error["message"] and not ChatRequest.objects.exists()


def test_djangos_own_body_cap_maps_to_the_same_413(settings):
    from django.core.exceptions import RequestDataTooBig

    from kvserve.errors import openai_exception_handler

    response = openai_exception_handler(RequestDataTooBig("too big"), {"view": None})
    assert response.status_code == 413 and response.data["error"]["code"] == "request_too_large"
    assert str(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) in response.data["error"]["message"]


def test_body_without_content_length_is_still_capped(chat_env, settings):
    import io

    from rest_framework.test import APIRequestFactory

    from kvserve.chat.parsers import LimitedJSONParser
    from kvserve.errors import ApiError

    settings.KVSERVE_MAX_BODY_BYTES = 10
    request = APIRequestFactory().post(URL, b"{}", content_type="application/json")
    request.META.pop("CONTENT_LENGTH", None)
    with pytest.raises(ApiError) as exc:
        LimitedJSONParser().parse(io.BytesIO(b'{"a": "' + b"z" * 50 + b'"}'), parser_context={"request": request})
    assert exc.value.status_code == 413


# ---- auth and throttling -----------------------------------------------------------------------

ENDPOINTS = [("post", URL), ("get", "/v1/models"), ("get", "/v1/models/x"), ("get", "/api/requests/chatcmpl-x"),
             ("get", "/api/requests/chatcmpl-x/stream")]


@pytest.mark.parametrize("method,url", ENDPOINTS)
def test_every_endpoint_needs_a_key(client, chat_env, method, url):
    assert_error(getattr(client, method)(url), 401, code="missing_api_key")
    assert_error(getattr(client, method)(url, HTTP_AUTHORIZATION="Bearer kvs-wrong"), 401, code="invalid_api_key")


def test_throttle_is_per_key_with_retry_after(client, chat_env, key, settings):
    settings.KVSERVE_THROTTLE_RATE = "2/min"
    assert client.get("/v1/models", **auth(key)).status_code == 200
    assert post(client, key, OK).status_code == 200
    response = post(client, key, OK)
    error = assert_error(response, 429, code="throttled")
    assert error["type"] == "rate_limit_error"
    assert 1 <= int(response["Retry-After"]) <= 60
    assert ChatRequest.objects.count() == 1  # the throttled call created nothing
    other = api_key_create("globex")[1]
    assert client.get("/v1/models", **auth(other)).status_code == 200


def test_throttle_off(client, chat_env, key, settings):
    settings.KVSERVE_THROTTLE_RATE = "off"
    assert all(client.get("/v1/models", **auth(key)).status_code == 200 for _ in range(5))


# ---- models ------------------------------------------------------------------------------------

def test_models_lists_the_served_model(client, chat_env, key):
    body = client.get("/v1/models", **auth(key)).json()
    name = model_get()["id"]
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [name] == ["SmolLM2-135M-Instruct"]
    assert set(body["data"][0]) == {"id", "object", "created", "owned_by"}
    assert client.get(f"/v1/models/{name}", **auth(key)).json()["id"] == name
    assert_error(client.get("/v1/models/gpt-4o", **auth(key)), 404, code="model_not_found")


# ---- a tenant's own requests -------------------------------------------------------------------

@pytest.fixture
def two_tenants(chat_env, client):
    mine, theirs = api_key_create("acme")[1], api_key_create("globex")[1]
    response = post(client, mine, OK)
    assert response.status_code == 200
    return mine, theirs, ChatRequest.objects.get(id=response.json()["id"])


def test_detail_of_own_request(client, two_tenants):
    mine, _, req = two_tenants
    ChatRequest.objects.filter(id=req.id).update(status="done", completion_tokens=5, finish_reason="stop",
                                                 handoff_verdict="OK", decode_verdict="accepted")
    body = client.get(f"/api/requests/{req.id}", **auth(mine)).json()
    assert body["id"] == req.id and body["object"] == "chat.request" and body["status"] == "done"
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == req.prompt_tokens
    assert body["verdicts"] == {"handoff": "OK", "decode": "accepted"} and body["error"] is None
    assert set(body["timings"]) == {"queued_ms", "prefill_ms", "transfer_ms", "decode_ms", "total_ms"}
    assert body["finish_reason"] == "stop" and body["params"]["seed"] == req.request_params.sampling.seed


def test_detail_shows_the_error(client, two_tenants):
    mine, _, req = two_tenants
    ChatRequest.objects.filter(id=req.id).update(status="failed", error_code="handoff_refused", error_message="no")
    assert client.get(f"/api/requests/{req.id}", **auth(mine)).json()["error"] == {
        "code": "handoff_refused", "message": "no"}


@pytest.mark.parametrize("suffix", ["", "/stream"])
def test_other_tenants_request_is_404(client, two_tenants, suffix):
    _, theirs, req = two_tenants
    error = assert_error(client.get(f"/api/requests/{req.id}{suffix}", **auth(theirs)), 404, code="not_found")
    assert req.prompt_hash not in json.dumps(error)
    assert_error(client.get(f"/api/requests/chatcmpl-nope{suffix}", **auth(theirs)), 404, code="not_found")


def test_stream_replay_of_own_request(client, two_tenants):
    mine, _, req = two_tenants
    response = client.get(f"/api/requests/{req.id}/stream", **auth(mine))
    assert response.status_code == 200 and response["Content-Type"].startswith("text/event-stream")
    events = sse_events(streaming_body(response))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == \
        "The capital is Paris."
    assert events[-2]["usage"]["total_tokens"] == 12 and events[-1] == "[DONE]"


def test_stream_replay_after_expiry_is_410(client, two_tenants, registry_redis):
    from kvserve.workers import outputs_get

    mine, _, req = two_tenants
    ChatRequest.objects.filter(id=req.id).update(status="done")
    registry_redis.delete(outputs_get().key(req.id))
    assert_error(client.get(f"/api/requests/{req.id}/stream", **auth(mine)), 410, code="stream_expired")


# ---- schema ------------------------------------------------------------------------------------

def test_schema_describes_the_chat_api(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    paths = schema["paths"]
    for path in ("/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/api/requests/{request_id}",
                 "/api/requests/{request_id}/stream"):
        assert path in paths, path
    op = paths["/v1/chat/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "401", "413", "429", "503"} <= set(op["responses"])
    assert op["security"] == [{"ApiKeyAuth": []}]
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
            "stream_options", "n", "user"} <= set(props)
