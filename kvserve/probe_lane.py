"""The probe lane: each engine worker consumes its probe queue (dispatch.probe_queue, one per Celery node) on a channel,
prefetch and threads of its own, apart from the Celery threads its role's queue fills. So the canary's live
probes reach, and are judged on, a worker whose every Celery thread is busy; the engine side of the lane is
its page reserve for canary-probe requests (inference/scheduler.py, KVSERVE_PROBE_RESERVE_PAGES).

The lane carries probes only: `kvserve.probe`, and `inference.decode` of a canary-probe request id; anything
else is dropped, logged. A probe runs with Task.apply in a lane thread (its task_prerun/postrun signals fire)
and its message is acked once it has run, like every task (acks late)."""
import logging
from concurrent.futures import ThreadPoolExecutor

from celery import bootsteps
from django import db
from django.conf import settings
from kombu import Consumer

from inference.probes import CANARY_PROBE_PREFIX
from kvserve.chat.runtime import runtime_worker_id
from kvserve.deliveries import delivery_done
from kvserve.dispatch import DECODE, PROBE, probe_queue

log = logging.getLogger(__name__)


def is_probe(task_name: str, args) -> bool:
    if task_name == PROBE:
        return True
    return task_name == DECODE and bool(args) and str(args[0]).startswith(CANARY_PROBE_PREFIX)


class ProbeLane(bootsteps.ConsumerStep):
    """Consumes this node's probe queue; only in a process that runs an engine (prefill or decode)."""

    def __init__(self, c, **kwargs):
        super().__init__(c, **kwargs)
        self.app, self.hostname = c.app, c.hostname
        self.size = settings.KVSERVE_PROBE_LANE_THREADS
        self.threads = ThreadPoolExecutor(self.size, thread_name_prefix="probe-lane")

    def get_consumers(self, channel):
        if runtime_worker_id() is None:  # web, beat or a maintenance-only worker: nothing to probe here
            channel.close()
            return []
        channel.basic_qos(0, self.size, False)  # this channel's own prefetch: what the lane's threads can run
        log.info("probe lane: consuming %s with %d thread(s)", probe_queue(self.hostname).name, self.size)
        return [Consumer(channel, queues=[probe_queue(self.hostname)], callbacks=[self.received], accept=["json"])]

    def received(self, body, message) -> None:
        self.threads.submit(self.run, body, message)

    def run(self, body, message) -> None:
        headers = message.headers or {}
        name, task_id = headers.get("task"), headers.get("id")
        try:
            args, kwargs, _embed = body
            if is_probe(name, args):
                self.app.tasks[name].apply(args=args, kwargs=kwargs, task_id=task_id)
            else:
                log.error("probe lane: dropped %s[%s]: the lane carries canary probes only", name, task_id)
                self.dropped(task_id)
        except Exception:
            log.exception("probe lane: %s[%s] failed", name, task_id)
        finally:
            db.close_old_connections()
            try:
                message.ack()
            except Exception:  # the broker connection dropped: the message comes back, a probe is repeatable
                log.exception("probe lane: ack of %s[%s] failed", name, task_id)

    def dropped(self, task_id: str | None) -> None:
        if task_id and runtime_worker_id():
            delivery_done(runtime_worker_id(), task_id)
