"""inference.metrics against real Redis: the hash encoding of counters and histograms, rendering, and one worker's
observations (token timings with injected clocks, engine counters by delta, gauges, a flush that fails)."""
import json

import pytest
import redis
from prometheus_client.core import HistogramMetricFamily

from inference.engine import Engine, EngineConfig, StepEvent
from inference.metrics import (FAMILIES, Batch, WorkerMetrics, families_read, families_render, metrics_key,
                               worker_gauges_read)
from inference.sequence import SamplingParams, Sequence


def rendered(redis_client, prefix) -> dict:
    out = {}
    for family in families_render(families_read(redis_client, prefix)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_and_histograms_add_up_across_batches(redis_client, ledger_prefix):
    Batch().inc("generation_tokens", 5, model_name="m").observe("inter_token_latency_seconds", 0.005,
                                                                model_name="m").send(redis_client, ledger_prefix)
    b = Batch()
    for seconds in (0.004, 0.03, 99.0):
        b.observe("inter_token_latency_seconds", seconds, model_name="m")
    b.inc("generation_tokens", model_name="m").inc("request_success", model_name="m", finished_reason="stop")
    b.send(redis_client, ledger_prefix)
    m = rendered(redis_client, ledger_prefix)
    assert m[("kvserve_generation_tokens_total", (("model_name", "m"),))] == 6
    assert m[("kvserve_request_success_total", (("finished_reason", "stop"), ("model_name", "m")))] == 1
    le = {dict(k[1])["le"]: v for k, v in m.items() if k[0] == "kvserve_inter_token_latency_seconds_bucket"}
    assert le["0.0025"] == 0 and le["0.005"] == 2 and le["0.025"] == 2 and le["0.05"] == 3  # <= le, cumulative
    assert le["20.0"] == 3 and le["+Inf"] == 4
    assert m[("kvserve_inter_token_latency_seconds_count", (("model_name", "m"),))] == 4
    assert m[("kvserve_inter_token_latency_seconds_sum", (("model_name", "m"),))] == pytest.approx(99.039)
    # the raw layout: bucket counts (not cumulative), sum and count per label set
    raw = redis_client.hgetall(metrics_key(ledger_prefix, "inter_token_latency_seconds"))
    assert {k.decode(): float(v) for k, v in raw.items()} == {
        '["m"]|2': 2, '["m"]|5': 1, '["m"]|19': 1, '["m"]|count': 4, '["m"]|sum': pytest.approx(99.039)}


def test_families_are_named_and_labelled_as_declared():
    with pytest.raises(ValueError, match="takes labels"):
        Batch().inc("generation_tokens", model="m")
    with pytest.raises(ValueError, match="histogram"):
        Batch().inc("time_to_first_token_seconds", model_name="m")
    families = families_render({}, {"time_to_first_token_seconds": [{"model_name": "m"}]})
    assert [f.name for f in families] == [f"kvserve_{name}" for name in FAMILIES]
    (ttft,) = [f for f in families if f.name == "kvserve_time_to_first_token_seconds"]
    assert isinstance(ttft, HistogramMetricFamily) and {s.value for s in ttft.samples} == {0.0}


def test_a_worker_times_tokens_from_arrival_and_between_tokens(redis_client, ledger_prefix):
    w = WorkerMetrics(redis_client, ledger_prefix, role="decode", model_name="m", worker_id="d1", gauges_ttl_s=5)
    w.arrived("r1", arrival_s=1000.0)
    w.on_token("r1", finished=False, now=50.0, wall=1000.4)  # first token: 0.4 s after arrival
    w.on_token("r1", finished=False, now=50.03)
    w.on_token("r1", finished=True, now=50.08)
    w.on_token("r2", finished=True, now=60.0)  # never announced: no time to first token, still a token
    w._batch.send(redis_client, ledger_prefix)
    m = rendered(redis_client, ledger_prefix)
    assert m[("kvserve_time_to_first_token_seconds_count", (("model_name", "m"),))] == 1
    assert m[("kvserve_time_to_first_token_seconds_sum", (("model_name", "m"),))] == pytest.approx(0.4)
    assert m[("kvserve_inter_token_latency_seconds_count", (("model_name", "m"),))] == 2
    assert m[("kvserve_inter_token_latency_seconds_sum", (("model_name", "m"),))] == pytest.approx(0.08)
    assert m[("kvserve_generation_tokens_total", (("model_name", "m"),))] == 4
    assert not w._last and not w._arrival  # finished requests leave nothing behind


def test_flush_sends_engine_counters_by_delta_and_the_gauges(redis_client, ledger_prefix, tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_pages=16, page_size=16))
    w = WorkerMetrics(redis_client, ledger_prefix, role="decode", model_name="m", worker_id="d1", gauges_ttl_s=5)
    engine.add_request("r1", list(range(1, 20)), SamplingParams(max_tokens=2))
    w.on_step(engine.step())
    w.flush(engine, waiting=1)
    gauges = worker_gauges_read(redis_client, ledger_prefix, ["d1", "d2"])
    assert gauges["d2"] == {} and gauges["d1"] == {"role": "decode", "model_name": "m", "running": 1, "waiting": 1,
                                                   "pages": {"r1": 2}}
    assert 0 < redis_client.ttl(f"{ledger_prefix}:metrics:worker:d1") <= 5
    while engine.has_work:
        w.on_step(engine.step())
    w.flush(engine)
    w.flush(engine)  # nothing new: nothing counted twice
    m = rendered(redis_client, ledger_prefix)
    labels = (("model_name", "m"), ("role", "decode"))
    assert m[("kvserve_guard_checks_total", labels)] == engine.block_manager.num_guard_checks == 2
    assert m[("kvserve_scrubbed_pages_total", labels)] == engine.pool.num_scrubbed == 2  # its 2 pages, on free
    assert m[("kvserve_generation_tokens_total", (("model_name", "m"),))] == 2
    assert json.loads(redis_client.get(f"{ledger_prefix}:metrics:worker:d1"))["pages"] == {}


def test_a_failed_flush_keeps_its_increments_for_the_next(redis_client, ledger_prefix, tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_pages=16, page_size=16))
    w = WorkerMetrics(redis.Redis(port=1), ledger_prefix, role="prefill", model_name="m", worker_id="p1",
                      gauges_ttl_s=5)
    w.on_violation("foreign_read")
    engine.pool.scrub([1, 2, 3])
    with pytest.raises(redis.ConnectionError):
        w.flush(engine)
    w.on_violation("foreign_read")
    engine.pool.scrub([4])
    w.redis = redis_client  # Redis is back
    w.flush(engine)
    m = rendered(redis_client, ledger_prefix)
    violations = (("kind", "foreign_read"), ("model_name", "m"), ("role", "prefill"))
    assert m[("kvserve_guard_violations_total", violations)] == 2
    assert m[("kvserve_scrubbed_pages_total", (("model_name", "m"), ("role", "prefill")))] == 4


def test_step_events_count_decode_tokens_only(redis_client, ledger_prefix):
    w = WorkerMetrics(redis_client, ledger_prefix, role="decode", model_name="m", worker_id="d1", gauges_ttl_s=5)
    prefill = Sequence("p", [1, 2], SamplingParams(), prefill_only=True)
    decode = Sequence("d", [1, 2], SamplingParams())
    w.on_step([StepEvent(prefill, 7, "", True), StepEvent(decode, 8, "x", False), StepEvent(decode, None, "", True)])
    w._batch.send(redis_client, ledger_prefix)
    assert rendered(redis_client, ledger_prefix)[("kvserve_generation_tokens_total", (("model_name", "m"),))] == 1
    assert not w._last  # the failure event (no token) ended its tracking


def test_tokens_per_engine_step_are_a_histogram_of_the_decode_batch(redis_client, ledger_prefix):
    w = WorkerMetrics(redis_client, ledger_prefix, role="decode", model_name="m", worker_id="d1", gauges_ttl_s=5)
    seqs = [Sequence(f"d{i}", [1, 2], SamplingParams()) for i in range(3)]
    w.on_step([StepEvent(s, 8, "x", False) for s in seqs])  # a step of 3
    w.on_step([StepEvent(seqs[0], 9, "y", False), StepEvent(seqs[1], None, "", True)])  # of 1 (a failure: none)
    w.on_step([StepEvent(Sequence("p", [1], SamplingParams(), prefill_only=True), 7, "", True)])  # prefill: none
    w._batch.send(redis_client, ledger_prefix)
    m = rendered(redis_client, ledger_prefix)
    labels = (("model_name", "m"),)
    assert m[("kvserve_iteration_tokens_total_count", labels)] == 2
    assert m[("kvserve_iteration_tokens_total_sum", labels)] == 4
    assert m[("kvserve_iteration_tokens_total_bucket", (("le", "2.0"), ("model_name", "m")))] == 1
    assert m[("kvserve_iteration_tokens_total_bucket", (("le", "4.0"), ("model_name", "m")))] == 2


def test_preemptions_are_counted_once_per_preempted_sequence(redis_client, ledger_prefix, tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_pages=14, page_size=4))
    w = WorkerMetrics(redis_client, ledger_prefix, role="decode", model_name="m", worker_id="d1", gauges_ttl_s=5)
    for i in range(3):  # 3 x 6 pages at the end do not fit 14: the newest is preempted
        engine.add_request(f"r{i}", list(range(10 + 3 * i, 19 + 3 * i)), SamplingParams(max_tokens=14, ignore_eos=True))
    while engine.has_work:
        w.on_step(engine.step())
        w.flush(engine)
    assert engine.scheduler.num_preemptions > 0
    m = rendered(redis_client, ledger_prefix)
    labels = (("model_name", "m"), ("role", "decode"))
    assert m[("kvserve_num_preemptions_total", labels)] == engine.scheduler.num_preemptions
