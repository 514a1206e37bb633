"""inference.registry against real Redis (DB 15, unique prefix): liveness, quarantine, effective limit."""
import dataclasses
import json

import pytest

from inference.registry import Registry, WorkerInfo, WorkerNotRegistered


def test_worker_info_round_trips_and_ignores_unknown_fields(make_worker):
    info = make_worker("decode", faults=["no_scrub"])
    data = info.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert WorkerInfo.from_dict({**data, "added_later": 1}) == info


def test_a_registration_carries_its_precision_and_an_older_one_reads_as_fp32(make_worker):
    data = make_worker("decode").to_dict()
    assert data["precision"] == "fp32"  # the default: the engine's default
    assert WorkerInfo.from_dict({**data, "precision": "bf16"}).precision == "bf16"
    del data["precision"]  # written by a worker from before the field
    assert WorkerInfo.from_dict(data).precision == "fp32"


def test_register_then_live_with_role_filter(registry, make_worker):
    p = registry.register(make_worker("prefill", worker_id="p1"))
    d = registry.register(make_worker("decode", worker_id="d1"))
    assert p.heartbeat_at > 0 and p.started_at > 0
    assert {w.worker_id for w in registry.live_workers()} == {"p1", "d1"}
    assert [w.worker_id for w in registry.live_workers("decode")] == ["d1"]
    assert registry.live_workers("decode")[0] == d


def test_every_key_lives_under_prefix_workers(registry, registry_redis, registry_prefix, make_worker):
    registry.register(make_worker(worker_id="p1"))
    registry.quarantine("p1", "test")
    keys = {k.decode() for k in registry_redis.scan_iter(match=f"{registry_prefix}:*")}
    assert keys and all(k.startswith(f"{registry_prefix}:workers:") for k in keys)


def lapse(redis_client, key: str) -> None:
    """The key's TTL runs out now, on Redis' clock (which no test can move): an expiry in the past drops it."""
    redis_client.pexpireat(key, 1)


def test_expired_worker_disappears_and_is_pruned(registry, registry_redis, make_worker):
    registry.register(make_worker("prefill", worker_id="p1"))
    registry.register(make_worker("decode", worker_id="d1"))
    assert registry.effective_limit() == 8192
    info = {w: registry.key("info", w) for w in ("p1", "d1")}
    assert all(0 < registry_redis.pttl(key) <= 15_000 for key in info.values())  # they expire on Redis' clock
    registry_redis.pexpire(info["p1"], 1000)  # p1 nearly lapsed, and then
    registry.heartbeat("p1")  # its beat sets the full TTL again
    assert registry_redis.pttl(info["p1"]) > 1000
    lapse(registry_redis, info["d1"])  # d1 stopped beating: its TTL ran out
    assert [w.worker_id for w in registry.live_workers()] == ["p1"]
    assert registry_redis.smembers(registry.key("index")) == {b"p1"}
    assert registry.effective_limit() is None
    with pytest.raises(WorkerNotRegistered):
        registry.heartbeat("d1")


def test_heartbeat_applies_changes_and_refuses_unknown_or_protected(registry_redis, registry_prefix, make_worker):
    now = [1000.0]
    registry = Registry(registry_redis, prefix=registry_prefix, clock=lambda: now[0])
    first = registry.register(make_worker("decode", worker_id="d1"))
    now[0] += 1
    beat = registry.heartbeat("d1", faults=["no_scrub"], capacity_tokens=4096)
    assert beat.started_at == first.started_at and (first.heartbeat_at, beat.heartbeat_at) == (1000.0, 1001.0)
    assert registry.live_workers()[0].faults == ["no_scrub"]
    assert registry.live_workers()[0].capacity_tokens == 4096
    for bad in ({"colour": "red"}, {"worker_id": "x"}, {"quarantined": False}):
        with pytest.raises(ValueError):
            registry.heartbeat("d1", **bad)


def test_unregister(registry, make_worker):
    registry.register(make_worker(worker_id="p1"))
    registry.unregister("p1")
    assert registry.live_workers() == []


def test_quarantine_survives_heartbeat_reregister_and_unregister(registry, make_worker):
    info = make_worker("decode", worker_id="d1")
    registry.register(info)
    registry.quarantine("d1", "incident #1: foreign_read")
    assert registry.is_quarantined("d1")
    assert registry.heartbeat("d1").quarantined
    assert registry.register(dataclasses.replace(info, quarantined=False)).quarantined
    registry.unregister("d1")
    assert registry.is_quarantined("d1")
    assert registry.quarantine_reason("d1") == "incident #1: foreign_read"
    assert registry.release("d1") is True
    assert not registry.is_quarantined("d1")
    assert registry.release("d1") is False


def test_quarantined_ids_lists_live_and_gone_workers_under_this_prefix_only(registry_redis, registry, make_worker):
    registry.register(make_worker("decode", worker_id="d2"))
    for worker_id in ("d2", "d1", "gone:1"):
        registry.quarantine(worker_id, "test")
    Registry(registry_redis, prefix=registry.prefix + "-other").quarantine("d3", "test")
    assert registry.quarantined_ids() == ["d1", "d2", "gone:1"]
    registry.release("d1")
    assert registry.quarantined_ids() == ["d2", "gone:1"]


def test_effective_limit_is_min_of_window_and_capacity_over_both_pools(registry, make_worker):
    assert registry.effective_limit() is None
    registry.register(make_worker("prefill", worker_id="p1", window=8192, capacity_tokens=16384))
    assert registry.effective_limit() is None  # no decode worker
    registry.register(make_worker("decode", worker_id="d1", window=8192, capacity_tokens=6000))
    assert registry.effective_limit() == 6000
    registry.register(make_worker("prefill", worker_id="p2", window=4096, capacity_tokens=16384))
    assert registry.effective_limit() == 4096
    registry.register(make_worker("sandbox", worker_id="s1", window=100, capacity_tokens=100))
    assert registry.effective_limit() == 4096  # sandbox pools never serve traffic


def test_effective_limit_with_quarantine(registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1"))
    registry.register(make_worker("decode", worker_id="d1", capacity_tokens=8192))
    registry.register(make_worker("decode", worker_id="d2", capacity_tokens=2048))
    registry.quarantine("d2", "test")
    assert registry.effective_limit() == 2048  # still counted: conservative
    registry.quarantine("d1", "test")
    assert registry.effective_limit() is None  # no decode worker can serve
    registry.release("d1")
    assert registry.effective_limit() == 2048


def test_registries_with_different_prefixes_do_not_see_each_other(registry_redis, registry, make_worker):
    other = Registry(registry_redis, prefix=registry.prefix + "-other")
    registry.register(make_worker(worker_id="p1"))
    assert other.live_workers() == []


def test_silence_counts_rounds_without_a_beat_and_no_clock_can_fake_it(registry, make_worker):
    registry.register(make_worker(worker_id="p1"))
    registry.register(make_worker(worker_id="d1"))
    assert registry.silence(["p1", "d1", "never"]) == {"p1": 0, "d1": 0, "never": 0}  # first sight
    registry.heartbeat("p1")
    assert registry.silence(["p1", "d1", "never"]) == {"p1": 0, "d1": 1, "never": 1}
    registry.unregister("d1")  # a lapsed or deleted registration does not move the count either
    assert registry.silence(["p1", "d1"]) == {"p1": 1, "d1": 2}
    registry.register(make_worker(worker_id="d1"))  # back: it beat
    assert registry.silence(["d1"]) == {"d1": 0}
    registry.forget("d1")
    assert registry.silence(["d1"]) == {"d1": 0}
