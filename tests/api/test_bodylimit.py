"""The ASGI body cap on its own (plain ASGI: scope, receive, send): an announced oversized body is refused
without a single receive, a chunked one is read only up to the limit, a body within it reaches the app whole."""
import asyncio
import json

import pytest

from kvserve.bodylimit import BodyLimitMiddleware

LIMIT = 250


class App:
    """An ASGI app that reads its whole body, then one more message (a disconnect), and answers 200."""

    def __init__(self):
        self.scope = self.body = self.after = None

    async def __call__(self, scope, receive, send):
        self.scope, parts = scope, []
        while True:
            message = await receive()
            parts.append(message["body"])
            if not message["more_body"]:
                break
        self.body = b"".join(parts)
        self.after = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class Client:
    """The server side of one request: hands out `chunks` as http.request messages, then a disconnect."""

    def __init__(self, chunks, headers=()):
        self.scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": list(headers)}
        self.pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                        for i, c in enumerate(chunks)]
        self.receives, self.sent = 0, []

    async def receive(self):
        self.receives += 1
        return self.pending.pop(0) if self.pending else {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)

    def run(self, app):
        asyncio.run(BodyLimitMiddleware(app, LIMIT)(self.scope, self.receive, self.send))
        return self

    @property
    def status(self):
        return self.sent[0]["status"] if self.sent else None

    def json(self):
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


def assert_413(client):
    assert client.status == 413
    headers = dict(client.sent[0]["headers"])
    assert headers[b"content-type"] == b"application/json" and headers[b"connection"] == b"close"
    body = client.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "request_too_large" and str(LIMIT) in body["error"]["message"]


def test_announced_oversized_body_is_refused_before_any_read():
    app = App()
    client = Client([b"x" * 10], headers=[(b"content-length", str(10 * 2**30).encode())]).run(app)
    assert_413(client)
    assert client.receives == 0 and app.scope is None


def test_chunked_body_is_read_only_up_to_the_limit():
    app = App()
    client = Client([b"x" * 100] * 50, headers=[(b"transfer-encoding", b"chunked")]).run(app)
    assert_413(client)
    assert client.receives == 3 and len(client.pending) == 47 and app.scope is None  # 300 > 250 after 3


def test_a_short_content_length_cannot_smuggle_more_than_the_limit():
    app = App()
    client = Client([b"x" * 200, b"x" * 200], headers=[(b"content-length", b"10")]).run(app)
    assert_413(client)
    assert app.scope is None


@pytest.mark.parametrize("chunks", [[b"y" * LIMIT], [b"a" * 100, b"b" * 100, b"c" * 50], [b""]])
def test_body_within_the_limit_reaches_the_app_whole_with_its_length(chunks):
    app = App()
    client = Client(chunks, headers=[(b"transfer-encoding", b"chunked"), (b"x-kept", b"1")]).run(app)
    assert client.status == 200 and app.body == b"".join(chunks)
    headers = dict(app.scope["headers"])
    assert b"transfer-encoding" not in headers and headers[b"x-kept"] == b"1"
    assert headers.get(b"content-length") == (str(len(app.body)).encode() if app.body else None)
    assert app.after == {"type": "http.disconnect"}  # later receives come from the server again


def test_content_length_at_the_limit_passes():
    app = App()
    client = Client([b"z" * LIMIT], headers=[(b"content-length", str(LIMIT).encode())]).run(app)
    assert client.status == 200 and app.body == b"z" * LIMIT


def test_client_gone_mid_body_calls_nothing_and_sends_nothing():
    app = App()
    client = Client([b"x" * 10], headers=[(b"content-length", b"100")])
    client.pending[0]["more_body"] = True
    client.run(app)
    assert app.scope is None and client.sent == []


def test_other_scopes_pass_through_untouched():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope, await receive()))

    async def receive():
        return {"type": "lifespan.startup"}

    scope = {"type": "lifespan"}
    asyncio.run(BodyLimitMiddleware(app, LIMIT)(scope, receive, None))
    assert seen == [(scope, {"type": "lifespan.startup"})]
