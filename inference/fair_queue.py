"""The engine's waiting queue, fair across tenants: FIFO within a tenant, round-robin between tenants.

It owns only the order in which waiting sequences are offered to the scheduler. `peek` names the next one
without moving the turn, so a head that does not fit now keeps its turn; `pop_next` takes it and passes the
turn to the next tenant. With T tenants waiting, a tenant's head is offered within T picks, whatever the
others' backlogs. The scheduler peeks with a weight (pages each tenant holds), so the tenant holding least
goes first and the turn order breaks ties; `behind` and `pop` let it admit a smaller item past a head that
does not fit (a bounded bypass, inference.scheduler).
"""
from collections import OrderedDict, deque
from typing import Callable, Generic, Hashable, Iterator, Protocol, TypeVar


class HasTenant(Protocol):
    @property
    def tenant(self) -> Hashable: ...


T = TypeVar("T", bound=HasTenant)


class TenantQueues(Generic[T]):
    def __init__(self):
        self._queues: "OrderedDict[Hashable, deque[T]]" = OrderedDict()  # first key: the tenant whose turn it is
        self._len = 0

    def add(self, item: T) -> None:
        """Queue `item` behind its tenant's earlier items; a tenant new to the queue takes the last turn."""
        self._queues.setdefault(item.tenant, deque()).append(item)
        self._len += 1

    def push_front(self, item: T) -> None:
        """Queue `item` first of all (a preempted sequence, to be recomputed): head of its tenant's queue, and
        its tenant's turn now."""
        self._queues.setdefault(item.tenant, deque()).appendleft(item)
        self._queues.move_to_end(item.tenant, last=False)
        self._len += 1

    def peek(self, weight: Callable[[Hashable], float] | None = None) -> T | None:
        """The item whose turn it is (None when empty); the turn does not move. With `weight`, the head of the
        waiting tenant of least weight(tenant) (the scheduler's: pages it holds), the turn order breaking ties."""
        if weight is None:
            return next((queue[0] for queue in self._queues.values()), None)
        tenant = min(self._queues, key=weight, default=None)
        return None if tenant is None else self._queues[tenant][0]

    def pop_next(self) -> T:
        """Take the item whose turn it is; its tenant goes to the back of the turn order."""
        if not self._queues:
            raise IndexError("pop_next from an empty TenantQueues")
        item = self.peek()
        self.pop(item)
        return item

    def behind(self, head: T) -> Iterator[T]:
        """Every waiting item but `head`, in the order a bypass offers them: the other tenants' items in turn
        order (each tenant FIFO), then `head`'s tenant's later items."""
        for tenant, queue in list(self._queues.items()):
            if tenant != head.tenant:
                yield from list(queue)
        yield from [item for item in self._queues.get(head.tenant, ()) if item is not head]

    def pop(self, item: T) -> None:
        """Take `item` out wherever it waits (ValueError if it does not); its tenant, if it still waits, goes
        to the back of the turn order."""
        self.remove(item)
        if item.tenant in self._queues:
            self._queues.move_to_end(item.tenant)

    def remove(self, item: T) -> None:
        """Take `item` out wherever it waits (ValueError if it does not); the turn order is kept."""
        queue = self._queues.get(item.tenant)
        if queue is None:
            raise ValueError(f"{item!r} is not waiting")
        queue.remove(item)
        self._len -= 1
        if not queue:
            del self._queues[item.tenant]

    def tenants(self) -> list[Hashable]:
        """Tenants with waiting items, in turn order."""
        return list(self._queues)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, item) -> bool:
        queue = self._queues.get(getattr(item, "tenant", None))
        return queue is not None and item in queue

    def __iter__(self) -> Iterator[T]:
        """Every waiting item, tenant by tenant in turn order (not the pick order)."""
        for queue in self._queues.values():
            yield from queue
