"""bench.guards' ledger latency probe against a real Redis (DB 15, its own key prefix)."""
from bench.guards import measure_latency
from inference.ledger import RedisLedger


def test_measure_latency_leaves_the_pool_as_it_was(redis_client, ledger_prefix):
    pool = RedisLedger.register(redis_client, "bench", "sandbox", 8, 16, prefix=ledger_prefix)
    stats = measure_latency(pool, num_ops=20, num_pages=2)
    assert set(stats) == {"allocate_p50_us", "allocate_p99_us", "free_p50_us", "free_p99_us"}
    assert all(v > 0 for v in stats.values())
    assert pool.num_free() == 8
    pool.check_integrity()
