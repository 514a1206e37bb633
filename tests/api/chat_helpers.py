"""Fixtures' helpers for the chat API tests: a fake worker that answers on the request's output stream,
and an SSE parser."""
import json

from asgiref.sync import async_to_sync

from inference.events import Delta, Done, Usage
from inference.streams import OutputStream
from kvserve.dispatch import PREFILL


def sse_events(body: bytes) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    out = []
    for block in body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streaming_body(response) -> bytes:
    """All of a streamed response's body; an async iterator (SSE) is run to its end on an event loop."""
    content = response.streaming_content
    if not hasattr(content, "__aiter__"):
        return b"".join(content)

    async def collect():
        return b"".join([part async for part in content])

    return async_to_sync(collect)()


class FakeWorker:
    """Stands in for the prefill task the services send (its `send_task` replaces the Celery app's, which
    kvserve/dispatch.py calls): records each queued request and publishes the scripted events (deltas then
    done, or an error) on its output stream, as decode would."""

    def __init__(self, redis, prefix):
        self.outputs = OutputStream(redis, prefix=prefix)
        self.calls = []
        self.events = [Delta("The capital "), Delta("is Paris."), Done("stop", Usage(7, 5))]

    def send_task(self, name, args=None, queue=None, **_):
        assert name == PREFILL, f"only prefill is sent from the web side, not {name}"
        return self.apply_async(args, queue=queue)

    def apply_async(self, args, queue=None, **_):
        self.queues = getattr(self, "queues", []) + [queue]
        return self.delay(*args)

    def delay(self, request_id, prompt_ids):
        self.calls.append((request_id, prompt_ids))
        if self.events:
            self.outputs.publish_many([(request_id, e) for e in self.events])
