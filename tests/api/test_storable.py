"""Text PostgreSQL cannot store (U+0000, lone surrogates) is a 400 in the API's format wherever it is: in any
string of a body (known field or not, key or value) and in any URL path id or query value. Run on SQLite here
and on PostgreSQL by tests/api/test_on_postgres.py, where such text was a 500 (jsonb DataError)."""
import json

import pytest

from kvserve.chat.models import ChatRequest
from kvserve.chat.selectors import model_get
from tests.api.test_chat_api import MESSAGES, assert_error, auth, chat_env, key, two_tenants  # noqa: F401

pytestmark = [pytest.mark.django_db]

CHAT = {"model": "x", "messages": MESSAGES, "max_tokens": 4}
COMPLETION = {"model": "x", "prompt": "Hello", "max_tokens": 4}
NUL = "a\u0000b"


def posted(client, raw, url, body):
    # json.dumps writes U+0000 as \u0000 and a lone surrogate as \ud800: exactly what a client sends
    return client.post(url, json.dumps(body), content_type="application/json", **auth(raw))


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "stop": NUL}, "stop"),
    ({**CHAT, "stop": ["ok", NUL]}, "stop.1"),
    ({**CHAT, "messages": [{"role": "user", "content": NUL}]}, "messages.0.content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": NUL}]}]}, "messages.0.content.0.text"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "name": NUL}]}, "messages.0.name"),
    ({**CHAT, "user": NUL}, "user"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": NUL}}]}, "tools.0.function.name"),
    ({**CHAT, "metadata": {"note": NUL}}, "metadata.note"),  # a field nothing reads is still refused
    ({**CHAT, "metadata": {NUL: "x"}}, "metadata.a\\x00b"),  # keys too
    ({**CHAT, "response_format": {"type": NUL}}, "response_format.type"),
])
@pytest.mark.parametrize("char, code", [("\u0000", "null_character"), ("\ud800", "surrogates")])
def test_chat_body_string_that_cannot_be_stored_is_400(client, chat_env, key, body, param, char, code):
    body = json.loads(json.dumps(body).replace("\\u0000", json.dumps(char)[1:-1]))
    param = param.replace("\\x00", char.encode("unicode_escape").decode())
    assert_error(posted(client, key, "/v1/chat/completions", body), 400, code=code, param=param)
    assert not ChatRequest.objects.exists() and chat_env.calls == []


@pytest.mark.parametrize("body, param", [
    ({**COMPLETION, "stop": NUL}, "stop"),
    ({**COMPLETION, "prompt": NUL}, "prompt"),
    ({**COMPLETION, "prompt": [NUL]}, "prompt.0"),
    ({**COMPLETION, "suffix": NUL}, "suffix"),
    ({**COMPLETION, "user": NUL}, "user"),
])
def test_completion_body_string_that_cannot_be_stored_is_400(client, chat_env, key, body, param):
    assert_error(posted(client, key, "/v1/completions", body), 400, code="null_character", param=param)
    assert not ChatRequest.objects.exists() and chat_env.calls == []


@pytest.mark.parametrize("url", ["/api/requests/x%00y", "/api/requests/x%00y/stream", "/v1/models/x%00y",
                                 "/api/requests/chatcmpl-1?after=%00", "/admin/chat/chatrequest/x%00y/change/"])
def test_url_that_cannot_be_stored_is_400(client, chat_env, key, url):
    error = assert_error(client.get(url, **auth(key)), 400, code="null_character")
    assert error["param"].split(".")[0] in ("path", "query")


def test_the_same_requests_without_the_character_are_served(client, two_tenants):
    mine, _, req = two_tenants
    assert posted(client, mine, "/v1/chat/completions", {**CHAT, "model": model_get()["id"], "stop": "ab",
                                                            "user": "ab"}).status_code == 200
    assert client.get(f"/api/requests/{req.id}", **auth(mine)).status_code == 200
    assert_error(client.get("/api/requests/xy", **auth(mine)), 404, code="not_found")
