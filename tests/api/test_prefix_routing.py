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


# ---- the web side: which queue a request's prefill goes to (real Redis registry) -------------------------

import pytest  # noqa: E402

from kvserve.chat.routing import prefill_queue_for  # noqa: E402
from kvserve.tenants.models import Tenant  # noqa: E402


@pytest.mark.django_db
@pytest.mark.usefixtures("registry_settings")
def test_a_prompt_goes_to_its_prefix_workers_direct_queue_never_a_quarantined_one(registry, make_worker):
    tenant = Tenant.objects.create(name="acme")
    prompt = list(range(40))
    assert prefill_queue_for(tenant, None, prompt) is None  # no worker
    for i in range(3):
        registry.register(make_worker("prefill", worker_id=f"prefill-{i}", node=f"prefill{i}@host"))
    queue = prefill_queue_for(tenant, None, prompt)
    assert queue in {f"prefill{i}@host.dq2" for i in range(3)}
    assert prefill_queue_for(tenant, None, prompt[:16] + [7] * 10) == queue  # same scope and first page
    assert prefill_queue_for(tenant, None, prompt[:15]) is None  # shorter than a page: nothing to meet
    chosen = next(f"prefill-{i}" for i in range(3) if queue.startswith(f"prefill{i}@"))
    registry.quarantine(chosen, "test")
    assert prefill_queue_for(tenant, None, prompt) not in (queue, None)
    others = [f"prefill-{i}" for i in range(3) if f"prefill-{i}" != chosen]
    registry.quarantine(others[0], "test")
    assert prefill_queue_for(tenant, None, prompt) is None  # one left: the shared queue reaches it
