"""The request body cap, as plain ASGI around the Django app: a body over the limit is answered 413 in the
API's error format before Django (authentication included) sees the request. An announced Content-Length
over the limit is refused without reading a byte; a chunked body is read only up to the limit."""
import json

from kvserve.errors import api_error_body, request_too_large

Scope = dict
Message = dict


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class BodyLimitMiddleware:
    """Reads the whole body (at most `max_bytes`) before calling the app, then replays it as one
    `http.request` message with a matching Content-Length; later receives (disconnects) pass through."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)  # nothing read: the client may not even have sent it
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._refuse(send)  # stop reading here; the rest is never pulled
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in (b"content-length",
                                                                                     b"transfer-encoding")]
        if body or declared is not None:
            headers.append((b"content-length", str(len(body)).encode()))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": headers}, replay, send)

    async def _refuse(self, send) -> None:
        payload = json.dumps(api_error_body(request_too_large(self.max_bytes))).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
            # the unread rest of the body makes this connection unusable: the server closes it after this
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload, "more_body": False})
