"""TenantQueues: FIFO within a tenant, round-robin between tenants, a peeked head keeps its turn."""
from dataclasses import dataclass

import pytest

from inference.fair_queue import TenantQueues


@dataclass(eq=False)
class Item:
    tenant: str
    name: str


def drain(q: TenantQueues) -> list[str]:
    out = []
    while q:
        out.append(q.pop_next().name)
    return out


def test_round_robin_across_tenants_fifo_within_each():
    q = TenantQueues()
    for i in range(4):
        q.add(Item("A", f"a{i}"))
    q.add(Item("B", "b0"))
    q.add(Item("B", "b1"))
    q.add(Item("C", "c0"))
    assert len(q) == 7 and q.tenants() == ["A", "B", "C"]
    assert drain(q) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert len(q) == 0 and q.peek() is None


def test_a_flood_queued_first_does_not_delay_another_tenants_request_beyond_one_turn():
    q = TenantQueues()
    for i in range(1000):
        q.add(Item("flood", f"f{i}"))
    q.pop_next()
    late = Item("small", "s0")
    q.add(late)  # arrives after 999 waiting flood items: served within the number of tenants waiting
    assert [q.pop_next().name for _ in range(2)] == ["f1", "s0"]


def test_peek_does_not_move_the_turn():
    q = TenantQueues()
    q.add(Item("A", "a0"))
    q.add(Item("B", "b0"))
    assert q.peek().name == "a0" and q.peek().name == "a0"  # a head that does not fit now keeps its turn
    assert q.pop_next().name == "a0" and q.peek().name == "b0"


def test_remove_keeps_order_and_counts():
    q = TenantQueues()
    a0, a1, b0 = Item("A", "a0"), Item("A", "a1"), Item("B", "b0")
    for item in (a0, a1, b0):
        q.add(item)
    q.remove(a0)
    assert a0 not in q and a1 in q and len(q) == 2
    q.remove(b0)
    assert q.tenants() == ["A"] and drain(q) == ["a1"]
    with pytest.raises(ValueError):
        q.remove(b0)
    with pytest.raises(IndexError):
        q.pop_next()


def test_every_item_is_eventually_popped_whatever_the_arrivals():
    import random

    rng = random.Random(7)
    q, added, popped = TenantQueues(), [], []
    for step in range(2000):
        if rng.random() < 0.6:
            item = Item(rng.choice("AAAAAAAB C"), f"{step}")  # a heavy tenant, two light ones
            q.add(item)
            added.append(item)
        elif q:
            popped.append(q.pop_next())
    while q:  # no arrivals now: the rest drains, nothing is stuck
        popped.append(q.pop_next())
    assert sorted(map(id, popped)) == sorted(map(id, added))


def test_push_front_goes_first_and_the_turns_go_on_from_there():
    q = TenantQueues()
    for item in (Item("A", "a0"), Item("B", "b0"), Item("B", "b1"), Item("C", "c0")):
        q.add(item)
    q.push_front(Item("B", "b-preempted"))
    assert drain(q) == ["b-preempted", "a0", "c0", "b0", "b1"]


def test_a_weighted_peek_offers_the_lightest_tenants_head_and_the_turn_breaks_ties():
    q = TenantQueues()
    for name, tenant in (("a0", "A"), ("b0", "B"), ("c0", "C")):
        q.add(Item(tenant, name))
    held = {"A": 5, "B": 0, "C": 0}
    assert q.peek(held.__getitem__).name == "b0"  # B and C hold nothing: B's turn comes first
    assert q.peek().name == "a0"  # unweighted: the turn


def test_behind_offers_the_other_tenants_first_and_pop_sends_a_tenant_to_the_back():
    q = TenantQueues()
    for name, tenant in (("a0", "A"), ("a1", "A"), ("b0", "B"), ("c0", "C"), ("c1", "C")):
        q.add(Item(tenant, name))
    head = q.peek()
    assert [i.name for i in q.behind(head)] == ["b0", "c0", "c1", "a1"]
    q.pop(next(i for i in q.behind(head) if i.name == "c0"))
    assert q.tenants() == ["A", "B", "C"] and len(q) == 4  # C still waits: to the back (it was already there)
    q.pop(next(i for i in q.behind(head) if i.name == "b0"))
    assert q.tenants() == ["A", "C"] and q.peek() is head
