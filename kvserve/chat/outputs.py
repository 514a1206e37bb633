"""A request's output events (inference.streams) rendered as OpenAI responses: the whole answer (sync: waits in
the calling thread) and server-sent chunks (async: waits on the event loop, so an open stream holds no blocked
thread), in the shape of the request's endpoint (kvserve/chat/shapes.py: chat.completion, text_completion).

The response that created a request ends it when it stops waiting early: its client disconnected
(`client_disconnected`), no output came in time (`timeout`) or Redis failed under it
(`backend_unavailable`). The request's worker then aborts it and frees its pages."""
import asyncio
import json
import logging
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from functools import lru_cache

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import StreamingHttpResponse

from inference.events import Delta, Done, Error, Usage, is_final
from inference.streams import AsyncOutputStream, OutputStream, ReaderStopped, async_client
from kvserve.chat.models import ChatRequest
from kvserve.chat.services import chat_request_cancel
from kvserve.chat.shapes import CHAT
from kvserve.errors import ApiError, error_body
from kvserve.workers import outputs_get

log = logging.getLogger(__name__)
CLIENT_GONE = ("client_disconnected", "The client closed the connection before the answer was complete.")

# Worker-side failures are server faults, never the caller's: 503 (retryable) with type server_error and
# the failure's own code. The one exception is a worker's admission re-check, which is about the request.
SERVER_FAILURE_STATUS = 503
CLIENT_FAILURE_CODES = {"context_length_exceeded": ("messages", 400)}


@lru_cache(maxsize=8)
def _blocking_client(url: str, socket_timeout_s: float) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=socket_timeout_s, health_check_interval=30)


def _blocking_outputs(timeout_s: float) -> OutputStream:
    """OutputStream on a client whose socket timeout outlasts one XREAD BLOCK of `timeout_s` (redis-py's
    default socket timeout, 5 s, would cut every longer wait short)."""
    client = _blocking_client(settings.REDIS_URL, timeout_s + 10)
    return OutputStream(client, prefix=settings.KVSERVE_LEDGER_PREFIX)


def event_error(event: Error) -> ApiError:
    """The ApiError for a worker's error event (or the reader's own: timeout, backend_unavailable)."""
    code = event.code or "server_error"
    message = event.message or "The request failed on the server."
    if code in CLIENT_FAILURE_CODES:
        param, status = CLIENT_FAILURE_CODES[code]
        return ApiError(message, status_code=status, param=param, code=code)
    return ApiError(message, status_code=SERVER_FAILURE_STATUS, type="server_error", code=code)


def _timeout_event(timeout_s: float) -> Error:
    return Error("timeout", f"No output from the workers for {timeout_s}s; the request did not complete.")


def _backend_event(exc: Exception) -> Error:
    return Error("backend_unavailable", f"Lost the output stream: {exc.__class__.__name__}")


def _give_up(req: ChatRequest, event: Error) -> None:
    """The waiting response stops here: the request ends with the event's code (unless it already ended)."""
    try:
        chat_request_cancel(req.id, code=event.code, message=event.message)
    except Exception:
        log.exception("could not end request %s (%s)", req.id, event.code)


def _usage(usage: Usage | None, req: ChatRequest) -> dict:
    prompt = usage.prompt_tokens if usage else req.prompt_tokens
    completion = usage.completion_tokens if usage else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens if usage else 0}}


def completion_wait(req: ChatRequest, *, fingerprint: str = "", gone=None, shape=CHAT) -> dict:
    """Blocks until the request finishes; its answer (a chat.completion by default), or ApiError on failure
    (never a partial answer). `gone` (a threading.Event) is set when the client disconnects: the request ends."""
    timeout_s = settings.KVSERVE_RESPONSE_TIMEOUT_S
    text, done, logprobs = defaultdict(list), None, defaultdict(list)  # by choice index
    try:
        for event in _blocking_outputs(timeout_s).read(req.id, timeout_s=timeout_s, stop=gone):
            if isinstance(event, Delta):
                text[event.index].append(event.text)
                logprobs[event.index].extend(event.logprobs or ())
            elif isinstance(event, Done):
                done = event
            else:
                raise event_error(event)
    except ReaderStopped:
        code, message = CLIENT_GONE
        _give_up(req, Error(code, message))
        raise ApiError(message, status_code=499, code=code)  # nobody reads it: the client has gone
    except TimeoutError:
        _give_up(req, event := _timeout_event(timeout_s))
        raise event_error(event)
    except redis.RedisError as exc:
        _give_up(req, event := _backend_event(exc))
        raise event_error(event)
    base = {"id": req.id, "created": int(req.created_at.timestamp()), "model": req.model,
            "system_fingerprint": fingerprint}
    answer = shape.answer(base, "".join(text[0]), done.finish_reason or "stop", logprobs[0], _usage(done.usage, req))
    if done.choices is not None:  # n choices: the returned ones in answer order (best_of's best first), indexed 0..
        answer["choices"] = [shape.choice(i, "".join(text[c.index]), c.finish_reason or "stop", logprobs[c.index])
                             for i, c in enumerate(done.choices)]
    return answer


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def completion_chunks(req: ChatRequest, *, include_usage: bool, fingerprint: str = "",
                            ends_request: bool = False, shape=CHAT,
                            continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """The request's events as SSE chunks (chat.completion.chunk by default): a role chunk (chat), content
    chunks, a chunk with the finish_reason, a usage chunk when asked, then `[DONE]`. A failure is
    `data: {"error": {...}}` then `[DONE]`. Reads with redis.asyncio on the event loop; its own connection
    closes with the stream.
    `continuous_usage` (vLLM's stream_options.continuous_usage_stats): every chunk carries `usage`, the
    completion tokens generated so far (the workers count them on each delta), the final usage on the last.
    `ends_request`: this is the response that created the request, and when it stops before the final
    event (client gone, timeout, Redis lost) the request ends too (a replay's reader ends nothing)."""
    timeout_s, keepalive_s = settings.KVSERVE_RESPONSE_TIMEOUT_S, max(1, settings.KVSERVE_SSE_KEEPALIVE_S)
    base = {"id": req.id, "object": shape.chunk_object(), "created": int(req.created_at.timestamp()),
            "model": req.model, "system_fingerprint": fingerprint}
    sent = Counter()  # characters of text sent so far per choice (text offsets of legacy logprobs)
    generated: dict[int, int] = {}  # completion tokens so far per choice, as its last delta counted them
    choices = req.request_params
    held = defaultdict(list) if choices.ranked else None  # best_of > n (a replay): only the best, at the end

    def chunk(choice: dict, usage: dict | None = None) -> bytes:
        if not continuous_usage:
            return _sse({**base, "choices": [choice]})
        so_far = sum(generated.values())
        usage = usage or {"prompt_tokens": req.prompt_tokens, "completion_tokens": so_far,
                          "total_tokens": req.prompt_tokens + so_far}
        return _sse({**base, "choices": [choice], "usage": usage})

    def error(event: Error) -> bytes:
        exc = event_error(event)
        return _sse(error_body(exc.detail, type=exc.error_type, param=exc.param, code=exc.error_code))

    async def give_up(event: Error) -> None:
        if ends_request:
            await asyncio.shield(sync_to_async(_give_up)(req, event))

    client = async_client(settings.REDIS_URL)
    stream = AsyncOutputStream(client, prefix=settings.KVSERVE_LEDGER_PREFIX)
    ended = False  # the final event (or our own give-up) was reached
    try:
        for choice in shape.opening(choices.num_returned):
            yield chunk(choice)
        try:
            async for event in stream.read(req.id, timeout_s=timeout_s, idle_s=keepalive_s):
                ended = event is not None and is_final(event)
                if event is None:
                    yield b": keep-alive\n\n"
                elif isinstance(event, Delta):
                    if event.tokens is not None:
                        generated[event.index] = event.tokens
                    if held is not None:
                        held[event.index].append(event)
                    elif event.text or event.logprobs:
                        choice = shape.delta(event.text, event.logprobs or [], sent[event.index], event.index)
                        if choice is not None:  # None: held back (a tool call's text until it closes)
                            yield chunk(choice)
                        sent[event.index] += len(event.text)
                elif isinstance(event, Done):
                    final = _usage(event.usage, req)
                    if event.choices is None:
                        yield chunk(shape.finish(event.finish_reason or "stop"), final)
                    for i, c in enumerate(event.choices or ()):
                        index = i if held is not None else c.index
                        for d in (held or {}).get(c.index, ()):
                            if d.text or d.logprobs:
                                choice = shape.delta(d.text, d.logprobs or [], sent[index], index)
                                if choice is not None:
                                    yield chunk(choice)
                                sent[index] += len(d.text)
                        yield chunk(shape.finish(c.finish_reason or "stop", index), final)
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(event.usage, req)})
                else:
                    yield error(event)
        except TimeoutError:
            ended = True
            await give_up(event := _timeout_event(timeout_s))
            yield error(event)
        except redis.RedisError as exc:
            ended = True
            await give_up(event := _backend_event(exc))
            yield error(event)
        yield _sse("[DONE]")
    finally:
        if not ended:  # the client went away mid-stream (Django cancelled or closed us)
            code, message = CLIENT_GONE
            await give_up(Error(code, message))
        await client.aclose()


def sse_response(chunks: AsyncIterator[bytes]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(chunks, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass events through as they come
    return response


def output_stream_exists(req: ChatRequest) -> bool:
    return bool(outputs_get().redis.exists(outputs_get().key(req.id)))
