"""Pool utilization over the last hour: at most one sample per worker per SAMPLE_EVERY_S, in a capped Redis list."""
import json
import time

HISTORY_S = 3600
SAMPLE_EVERY_S = 10
MAX_SAMPLES = HISTORY_S // SAMPLE_EVERY_S + 10


def _key(prefix: str, worker_id: str, part: str = "") -> str:
    return f"{prefix}:dashboard:util:{worker_id}{part}"


def utilization_sample_record(redis, prefix: str, worker_id: str, *, used: int, free: int, dirty: int,
                              now: float | None = None) -> bool:
    """Records (ts, used, free, dirty) unless a sample was taken in the last SAMPLE_EVERY_S; True when recorded."""
    now = time.time() if now is None else now
    if not redis.set(_key(prefix, worker_id, ":gate"), "1", nx=True, ex=SAMPLE_EVERY_S):
        return False
    pipe = redis.pipeline()
    pipe.lpush(_key(prefix, worker_id), json.dumps([round(now, 3), used, free, dirty]))
    pipe.ltrim(_key(prefix, worker_id), 0, MAX_SAMPLES - 1)
    pipe.expire(_key(prefix, worker_id), HISTORY_S + 60)  # a worker that is gone leaves nothing behind
    pipe.execute()
    return True


def utilization_history_get(redis, prefix: str, worker_id: str, now: float | None = None) -> list[list]:
    """[[ts, used, free, dirty], ...] of the last HISTORY_S seconds, oldest first."""
    now = time.time() if now is None else now
    samples = [json.loads(raw) for raw in redis.lrange(_key(prefix, worker_id), 0, MAX_SAMPLES - 1)]
    return [s for s in reversed(samples) if s[0] >= now - HISTORY_S]
