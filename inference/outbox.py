"""A worker's output events on their way to Redis: the engine loop hands each step's events over and steps on; one
thread publishes them in order, a batch at a time, exactly once (inference.streams.publish_many: a batch keeps its
key until Redis answers it, so a repeat after a lost reply appends nothing twice).

A request's future is resolved by the callback its final event was handed over with, run once a publish of that
event was attempted (answered, or failed: with Redis down a request still ends, its events wait in the outbox)."""
import logging
import threading
import uuid
from collections.abc import Callable

import redis as redis_lib

from inference.events import OutputEvent
from inference.streams import OutputStream

log = logging.getLogger(__name__)

MAX_OUTBOX = 100_000  # output events kept while Redis is unreachable
RETRY_S = (0.05, 0.1, 0.2, 0.5)  # waits between attempts while Redis refuses a batch


class Outbox:
    def __init__(self, outputs: OutputStream, *, max_events: int = MAX_OUTBOX, name: str = "outbox"):
        self.outputs = outputs
        self.max_events = max_events
        self._cond = threading.Condition()
        self._queued: list[tuple[str, OutputEvent]] = []  # handed over, not yet in a batch
        self._then: list[tuple[int, Callable[[], None]]] = []  # (events handed over before it, callback)
        self._handed = 0  # events handed over since the start
        self._batch: list[tuple[str, OutputEvent]] = []  # the batch Redis has not answered yet
        self._batch_key = uuid.uuid4().hex
        self._answered: str | None = None
        self._taken = 0  # events moved into batches since the start (the batch's last one included)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, events: list[tuple[str, OutputEvent]], then: Callable[[], None] | None = None) -> None:
        """Hands events over (in order after every earlier one); `then` runs on the outbox's thread once they were
        attempted. Never blocks on Redis."""
        if not events and then is None:
            return
        with self._cond:
            self._queued.extend(events)
            self._handed += len(events)
            if then is not None:
                self._then.append((self._handed, then))
            self._cond.notify()

    def pending(self) -> int:
        """Events not yet answered by Redis."""
        with self._cond:
            return len(self._queued) + len(self._batch)

    def drain(self, timeout_s: float) -> bool:
        """Waits until every event handed over was answered (True) or `timeout_s` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued and not self._batch and not self._then, timeout_s)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Publishes what it can within `timeout_s`, then the thread ends (callbacks still waiting run now)."""
        self.drain(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        self._run_callbacks(everything=True)

    # ---- the outbox's thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued or self._batch or self._then or self._stopping)
                if self._stopping:
                    return
                self._batch.extend(self._queued)  # a batch not answered yet takes what came since at its tail
                self._taken += len(self._queued)
                self._queued = []
                batch, key, answered = list(self._batch), self._batch_key, self._answered
            ok = self._publish(batch, key, answered)
            with self._cond:
                if ok:  # only this thread fills the batch: it is all answered
                    self._batch = []
                    self._answered, self._batch_key = key, uuid.uuid4().hex
                elif len(self._batch) > self.max_events:  # the batch's head is gone: what follows is a batch of its own
                    del self._batch[: len(self._batch) - self.max_events]
                    self._batch_key = uuid.uuid4().hex
                self._cond.notify_all()
            self._run_callbacks()
            failures = 0 if ok else failures + 1
            if not ok:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, RETRY_S[min(failures, len(RETRY_S)) - 1])

    def _publish(self, batch, key: str, answered: str | None) -> bool:
        if not batch:
            return True
        try:
            self.outputs.publish_many(batch, batch=key, answered=answered)
            return True
        except redis_lib.RedisError as exc:
            log.warning("%d output events wait for Redis: %r", len(batch), exc)
            return False
        except Exception:  # a bug: the events are dropped, the callbacks still run (no request waits forever)
            log.exception("publishing %d output events failed", len(batch))
            return True

    def _run_callbacks(self, everything: bool = False) -> None:
        with self._cond:
            ready = [cb for n, cb in self._then if everything or n <= self._taken]
            self._then = [(n, cb) for n, cb in self._then if not (everything or n <= self._taken)]
            if ready:
                self._cond.notify_all()
        for cb in ready:
            try:
                cb()
            except Exception:
                log.exception("an outbox callback failed")
