"""Request bodies against the real uvicorn: over the cap is a 413 in the API's error format, decided before
authentication, from Content-Length without reading the body, or after at most the cap of a chunked body;
the connection is closed, never held. A chunked body within the cap reaches the API whole."""
import json
import select
import socket
import time
from urllib.parse import urlparse

import pytest

LIMIT = 1024 * 1024  # the stack's default KVSERVE_MAX_BODY_BYTES
CHUNK = b"x" * 65536


def exchange(url: str, head: bytes, chunks, timeout_s: float = 60.0) -> dict:
    """Sends `head`, then `chunks` for as long as the server has not answered (nothing is allocated up
    front); reads the answer and whether the server then closed the connection."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=timeout_s)
    sock.sendall(head)
    sent, pending, chunks = 0, b"", iter(chunks)
    sock.setblocking(False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending = pending or next(chunks, b"")
        if not pending:
            break
        readable, writable, _ = select.select([sock], [sock], [], 1.0)
        if readable:
            break  # answered (or closed) before the body was complete
        if writable:
            try:
                n = sock.send(pending)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent, pending = sent + n, pending[n:]
    sock.setblocking(True)
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        assert part, f"connection closed without an answer after {sent} bytes"
        data += part
    head_raw, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head_raw.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    try:
        while len(body) < int(headers.get("content-length", 0)):
            part = sock.recv(65536)
            if not part:
                break
            body += part
        closed = sock.recv(1) == b""
    except ConnectionResetError:
        closed = True
    except socket.timeout:
        closed = False
    finally:
        sock.close()
    return {"status": int(status_line.split()[1]), "headers": headers, "body": body, "sent": sent, "closed": closed}


def request_head(headers: dict) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(total_bytes: int):
    for _ in range(total_bytes // len(CHUNK)):
        yield b"%x\r\n" % len(CHUNK) + CHUNK + b"\r\n"
    yield b"0\r\n\r\n"


def assert_refused_413(reply: dict) -> None:
    assert reply["status"] == 413, reply
    error = json.loads(reply["body"])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_too_large"
    assert reply["headers"]["connection"] == "close" and reply["closed"]


@pytest.mark.timeout(180)
def test_30_mb_with_content_length_is_413_before_authentication(stack):
    size = 30 * 2**20
    reply = exchange(stack.url, request_head({"Content-Length": size}), (CHUNK for _ in range(size // len(CHUNK))))
    assert_refused_413(reply)  # no key was sent: a 401 would mean the body went on to authentication
    assert reply["sent"] < size


@pytest.mark.timeout(180)
def test_200_mb_chunked_is_read_only_up_to_the_limit(stack):
    size = 200 * 2**20
    reply = exchange(stack.url, request_head({"Transfer-Encoding": "chunked",
                                              "Authorization": f"Bearer {stack.api_key}"}), chunked(size))
    assert_refused_413(reply)
    # the server stopped reading at the cap; what was sent beyond it sat in socket buffers
    assert reply["sent"] < size // 4, reply["sent"]


@pytest.mark.timeout(120)
def test_announced_10_gb_with_a_few_bytes_sent_is_answered_at_once(stack):
    reply = exchange(stack.url, request_head({"Content-Length": 10 * 2**30}), [b'{"mes'], timeout_s=30)
    assert_refused_413(reply)
    assert reply["sent"] <= 5  # answered from the header (before or after the 5 bytes), and the socket closed


@pytest.mark.timeout(120)
def test_chunked_body_within_the_limit_reaches_the_api(stack):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 9}).encode()
    frame = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    reply = exchange(stack.url, request_head({"Transfer-Encoding": "chunked", "Connection": "close",
                                              "Authorization": f"Bearer {stack.api_key}"}), [frame])
    assert reply["status"] == 400, reply  # parsed: the API names the field it refuses
    assert json.loads(reply["body"])["error"]["param"] == "n"
