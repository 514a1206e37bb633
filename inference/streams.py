"""Per-request output events (inference.events) on a Redis stream: decode appends deltas and one final event;
the API reads them (blocking) for SSE and for non-streamed answers. No subscribe/publish race: a reader that
arrives late still sees every event from the start. A stream takes one final event: whatever is published for
it after that (a second error from whoever else ends the request, a late delta) is dropped.

Retention: while a request runs its stream lives `ttl_s` past its latest event; the final event cuts
that to the retention the API recorded at admission (`retain`), or to `replay_s` when none was.

A dropped connection is not a lost event: reads repeat from the last entry seen, and a publish is keyed by
its batch, so a batch repeated after its reply was lost appends nothing twice (inference.retry)."""
import asyncio
import json
import time
import uuid

import redis

from inference.events import OutputEvent, event_decode, event_encode, is_final
from inference.retry import repeat, repeat_async

# KEYS: the batch's key, the previous batch's key (or ''), then per event its stream and retention key; ARGV: running
# TTL, replay seconds, maxlen, then per event 'final' or 'delta' and its json. Appends the events past the count
# the batch's key records (a batch repeated after its reply was lost appends nothing twice), a final event
# marked (field k) and setting its stream's expiry; nothing is appended to a stream whose latest entry is
# marked final. Records the count; the previous batch, answered, no longer needs its key. Returns how many
# events were appended.
_PUBLISH_LUA = """
local ttl, replay, maxlen = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local n = (#ARGV - 3) / 2
local done = tonumber(redis.call('GET', KEYS[1]) or '0')
local ended, appended = {}, 0
for i = done + 1, n do
  local stream, keep_key = KEYS[1 + 2 * i], KEYS[2 + 2 * i]
  if ended[stream] == nil then
    local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
    ended[stream] = last ~= nil and last[2][3] == 'k'
  end
  if not ended[stream] then
    appended = appended + 1
    if ARGV[2 + 2 * i] == 'final' then
      redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'e', ARGV[3 + 2 * i], 'k', 'final')
      local keep = tonumber(redis.call('GET', keep_key)) or replay
      redis.call('EXPIRE', stream, keep)
      redis.call('EXPIRE', keep_key, keep)
      ended[stream] = true
    else
      redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'e', ARGV[3 + 2 * i])
      redis.call('EXPIRE', stream, ttl)
    end
  end
end
redis.call('SET', KEYS[1], string.format('%d', n), 'EX', ttl)
if KEYS[2] ~= '' then redis.call('DEL', KEYS[2]) end
return appended
"""
MAXLEN = 100_000
BLOCK_S = 1.0  # the longest XREAD BLOCK
REPLY_MARGIN_S = 10.0  # an async XREAD unanswered this long past its BLOCK: Redis stopped answering


def decode_entries(reply) -> list[tuple[bytes, OutputEvent]]:
    """(entry id, event) pairs of one XREAD reply on a single stream."""
    return [(entry_id, event_decode(fields[b"e"] if b"e" in fields else fields["e"])) for entry_id, fields in reply[0][1]]


class ReaderStopped(Exception):
    """The reader's caller stopped waiting (e.g. its HTTP client went away)."""


class OutputStream:
    def __init__(self, redis, prefix: str = "kvs", ttl_s: int = 3600, replay_s: int = 60):
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.replay_s = replay_s
        self._publish = redis.register_script(_PUBLISH_LUA)

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:out:{request_id}"

    def retention_key(self, request_id: str) -> str:
        return f"{self.prefix}:out:{request_id}:keep"

    def retain(self, request_id: str, keep_s: int) -> None:
        """Records, before the request is queued, how long its stream stays after its final event."""
        repeat(lambda: self.redis.set(self.retention_key(request_id), int(keep_s), ex=self.ttl_s + int(keep_s)),
               f"recording the retention of {request_id}")

    def batch_key(self, batch: str) -> str:
        return f"{self.prefix}:outbatch:{batch}"

    def publish_many(self, events: list[tuple[str, OutputEvent]], batch: str | None = None,
                     answered: str | None = None) -> int:
        """[(request_id, event)] in one atomic step, repeated after a dropped connection. `batch` keys the
        call: the same batch published again (its reply was lost, and events may have been added to its tail
        since) appends only what the earlier call did not; `answered`, an earlier batch whose call returned, is
        forgotten. Events for a stream that already holds its final event are dropped. Returns how many events
        were appended."""
        if not events:
            return 0
        keys = [self.batch_key(batch or uuid.uuid4().hex), self.batch_key(answered) if answered else ""]
        args = [self.ttl_s, self.replay_s, MAXLEN]
        for request_id, event in events:
            keys += [self.key(request_id), self.retention_key(request_id)]
            args += ["final" if is_final(event) else "delta", event_encode(event)]
        appended = int(repeat(lambda: self._publish(keys=keys, args=args), f"publishing {len(events)} output events"))
        if batch is None:  # a one-off call: its key is not needed past its answer
            try:
                self.redis.delete(keys[0])
            except redis.RedisError:
                pass  # it expires with the running TTL
        return appended

    def reads_key(self) -> str:
        return f"{self.prefix}:reads"

    def record_reads(self, records: list[dict]) -> None:
        """Appends finished requests' read records (BlockManager.read_record) to the audit stream, in one trip."""
        pipe = self.redis.pipeline(transaction=False)
        for record in records:
            pipe.xadd(self.reads_key(), {"r": json.dumps(record)}, maxlen=50_000, approximate=True)
        pipe.execute()

    def read_records(self, request_ids=None, count: int = 50_000) -> list[dict]:
        records = [json.loads(f[b"r"] if b"r" in f else f["r"]) for _, f in self.redis.xrevrange(self.reads_key(), count=count)]
        return [r for r in records if request_ids is None or r["request"] in request_ids]

    def publish(self, request_id: str, event: OutputEvent) -> bool:
        """True when appended (False: the stream had its final event already)."""
        return bool(self.publish_many([(request_id, event)]))

    def read(self, request_id: str, timeout_s: float, last_id: str = "0-0", stop=None):
        """Yields events until a final one (done/error); raises TimeoutError when none comes in time, and
        ReaderStopped soon after `stop` (a threading.Event) is set."""
        key = self.key(request_id)
        deadline = time.monotonic() + timeout_s
        block_s = BLOCK_S if stop is None else 0.25
        while True:
            if stop is not None and stop.is_set():
                raise ReaderStopped(request_id)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no output for {request_id} within {timeout_s}s")
            # short blocking reads: a client's socket timeout (redis-py's default is 5 s) never trips, and a
            # read repeated after a dropped connection is repeated within inference.retry's budget
            block_ms = max(1, int(min(left, block_s) * 1000))
            reply = repeat(lambda: self.redis.xread({key: last_id}, block=block_ms, count=256), f"reading {key}")
            if not reply:
                continue
            for last_id, event in decode_entries(reply):
                yield event
                if is_final(event):
                    return


def async_client(url: str):
    """The redis.asyncio client an AsyncOutputStream reads with: no socket_timeout, on purpose (redis-py 8's
    default is 5 s). With one, redis-py sends every command through asyncio.wait_for, and Python 3.11's wait_for
    swallows a cancel that arrives while the send completes (CPython gh-86296): the web's stream then never heard
    that its client had gone and ran the request to its end. AsyncOutputStream.read bounds each read itself
    (asyncio.timeout keeps a cancel)."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url, socket_timeout=None, socket_connect_timeout=REPLY_MARGIN_S)


class AsyncOutputStream:
    """The reading side of OutputStream for asyncio servers (a `redis.asyncio` client, from `async_client`): the
    same keys and events, read without holding a thread while waiting."""

    key = OutputStream.key

    def __init__(self, redis, prefix: str = "kvs"):
        self.redis = redis
        self.prefix = prefix

    async def exists(self, request_id: str) -> bool:
        return bool(await self.redis.exists(self.key(request_id)))

    async def read(self, request_id: str, timeout_s: float, last_id: str = "0-0", idle_s: float | None = None):
        """Yields events until a final one (done/error), and None after each `idle_s` of silence (for
        keep-alives); raises TimeoutError after `timeout_s` without an event, redis.TimeoutError when Redis
        leaves a read unanswered REPLY_MARGIN_S past its BLOCK."""
        key = self.key(request_id)
        silent = quiet = 0.0  # since the last event; since the last event or keep-alive
        while True:
            wait = min(BLOCK_S, timeout_s - silent, (idle_s - quiet) if idle_s is not None else BLOCK_S)
            block_ms = max(1, int(wait * 1000))
            try:
                async with asyncio.timeout(wait + REPLY_MARGIN_S):
                    reply = await repeat_async(lambda: self.redis.xread({key: last_id}, block=block_ms, count=256),
                                               f"reading {key}")
            except TimeoutError as exc:  # ours (asyncio.timeout): redis-py's own is a redis.TimeoutError
                raise redis.TimeoutError(f"Redis left XREAD on {key} unanswered past its block") from exc
            if not reply:
                silent, quiet = silent + wait, quiet + wait
                if silent >= timeout_s:
                    raise TimeoutError(f"no output for {request_id} within {timeout_s}s")
                if idle_s is not None and quiet >= idle_s:
                    quiet = 0.0
                    yield None
                continue
            quiet = 0.0
            silent = 0.0
            for last_id, event in decode_entries(reply):
                yield event
                if is_final(event):
                    return
