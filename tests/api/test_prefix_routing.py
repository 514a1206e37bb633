"""Prefix-affinity routing: one scope's prefix lands on one worker, stably; scopes spread; fallback when unknown."""
from collections import Counter

from kvserve.chat.routing import prefill_worker_for, prefix_route_key

WORKERS = [f"prefill-{i}" for i in range(4)]


def test_same_scope_and_first_page_route_to_one_worker_whatever_follows():
    key = prefix_route_key("s" * 64, list(range(40)), 16)
    assert key == prefix_route_key("s" * 64, list(range(16)) + [999] * 30, 16)
    assert len({prefill_worker_for(key, WORKERS[::-1]) for _ in range(3)} | {prefill_worker_for(key, WORKERS)}) == 1


def test_other_scopes_route_independently_and_spread():
    chosen = Counter(prefill_worker_for(prefix_route_key(f"{i:064d}", list(range(16)), 16), WORKERS)
                     for i in range(400))
    assert set(chosen) == set(WORKERS) and min(chosen.values()) > 60  # ~100 each


def test_a_worker_leaving_moves_only_its_own_keys():
    keys = [prefix_route_key(f"{i:064d}", list(range(16)), 16) for i in range(200)]
    before = {k: prefill_worker_for(k, WORKERS) for k in keys}
    after = {k: prefill_worker_for(k, WORKERS[1:]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != WORKERS[0])


def test_no_key_or_no_worker_means_any_worker():
    assert prefix_route_key("s" * 64, list(range(15)), 16) is None
    assert prefill_worker_for(None, WORKERS) is None
    assert prefill_worker_for(prefix_route_key("s" * 64, list(range(16)), 16), []) is None
