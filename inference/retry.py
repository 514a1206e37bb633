"""Repeating a Redis command that is safe to repeat across a dropped connection.

A dropped connection (redis.ConnectionError: the server closed it, a reset, a refused reconnect) loses the
reply, not necessarily the command: the server may have run it. redis-py drops the connection and the next
command connects afresh, so a command whose repeat cannot harm (a read, a lease renewal, a keyed write, a
ledger script whose epoch or owner checks refuse a repeat: inference.ledger.REPEAT) runs again after a short
backoff, a few times, within a total well under any lease TTL. Every other command fails closed on the first
error, as the project's clients are built without redis-py's own retries. A TimeoutError is not repeated:
a server that stopped answering would only be waited on again.
"""
import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

import redis

log = logging.getLogger(__name__)
T = TypeVar("T")
DROPPED = (redis.ConnectionError,)
BACKOFF_S = (0.05, 0.2, 0.5)  # waits between attempts: four attempts at most
BUDGET_S = 2.0  # no attempt starts later than this after the first drop (leases live >= 4 s, 30 s by default)


def _after_drop(exc: Exception, what: str, attempt: int, dropped: float, budget_s: float) -> float:
    """The wait before attempt `attempt + 1` (the first drop was at `dropped`); re-raises `exc` when the call
    gives up. The budget counts from the first drop, not the first attempt: a blocking read may have waited
    long before."""
    delay = BACKOFF_S[attempt] if attempt < len(BACKOFF_S) else None
    if delay is None or time.monotonic() - dropped + delay > budget_s:
        log.warning("Redis connection dropped during %s %d times in %.1fs; giving up: %r", what,
                    attempt + 1, time.monotonic() - dropped, exc)
        raise exc
    log.info("Redis connection dropped during %s (%r); repeating it in %.2fs", what, exc, delay)
    return delay


def repeat(call: Callable[[], T], what: str, budget_s: float = BUDGET_S) -> T:
    """call(), repeated after a dropped connection; the last error is raised when the backoff runs out."""
    dropped, attempt = None, 0
    while True:
        try:
            return call()
        except DROPPED as exc:
            dropped = dropped or time.monotonic()
            delay = _after_drop(exc, what, attempt, dropped, budget_s)
        attempt += 1
        time.sleep(delay)


async def repeat_async(call: Callable[[], Awaitable[T]], what: str, budget_s: float = BUDGET_S) -> T:
    """repeat() for a redis.asyncio command."""
    dropped, attempt = None, 0
    while True:
        try:
            return await call()
        except DROPPED as exc:
            dropped = dropped or time.monotonic()
            delay = _after_drop(exc, what, attempt, dropped, budget_s)
        attempt += 1
        await asyncio.sleep(delay)
