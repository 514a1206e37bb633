"""How many threads this process computes with: torch's intra-op threads (`KVSERVE_TORCH_THREADS`, set once at
start) and the native kernels' pool (inference/native/pool.cpp), and the budget workers on one host share.

Workers sharing a host must not oversubscribe its cores: an OpenMP op waits at its barrier for
every one of its threads, so a thread descheduled by another process's threads stalls the whole op.
Defaults: a prefill or decode worker starts with half the host's cores (at least one), since `make run`
puts one of each on the same host; anything else (the CLI, benchmarks) takes every core. With
KVSERVE_THREAD_BUDGET=lend (the default), `CoreBudget` lends a worker's native kernels every core while no other
worker on the host has work (their pool never waits for a helper that another process holds off its core; torch's
threads stay fixed); with =shared it moves torch's threads too; with =fixed nothing moves.
Within a process the two kinds of threads take turns on the same cores: torch's idle OpenMP threads spin only
briefly (GOMP_SPINCOUNT, set before torch loads: inference/__init__.py), so the native kernels' helpers get them.
"""
import fcntl
import logging
import mmap
import os
import struct
import tempfile
from pathlib import Path

import torch

from inference import native
from inference.settings import env_int, thread_budget_setting

log = logging.getLogger(__name__)

WORKER_ROLES = ("prefill", "decode")


def torch_threads_for(role: str | None = None, env=None) -> int:
    cores = os.cpu_count() or 1
    n = env_int("KVSERVE_TORCH_THREADS", None, low=1, env=env)  # threads per process
    if n is not None:
        return n
    return max(1, cores // 2) if role in WORKER_ROLES else cores


def threads_set(n: int) -> int:
    """Sets torch's intra-op thread count and the native kernels' pool to `n`; returns it."""
    torch.set_num_threads(n)
    if native.fused_available():
        native.set_threads(n)
    return n


def torch_threads_apply(role: str | None = None) -> int:
    """Sets torch's intra-op thread count for this process, and the native kernels' to the same; returns it."""
    n = threads_set(torch_threads_for(role))
    log.info("torch intra-op threads: %d (%s role, %d cores; KVSERVE_TORCH_THREADS overrides)",
             n, role or "no", os.cpu_count() or 1)
    return n



class CoreBudget:
    """The cores of one host shared by the workers on it (`KVSERVE_THREAD_BUDGET=lend`, the default, or `shared`).

    Each worker process holds a slot of a small shared file saying whether it has work. A worker about
    to step takes cores // (live workers with work, itself included): every core while it is the only
    one with work, its share when others have work too. A dead process's slot counts for nothing and is
    taken over. One step of oversubscription at most: a worker that grew gives its cores back at its
    next step. `torch_too`: torch's intra-op threads follow the budget as well as the native kernels' (shared).
    """

    SLOT = struct.Struct("<qq")  # pid, has work (0/1)
    SLOTS = 64

    def __init__(self, path: Path, cores: int, pid: int | None = None, torch_too: bool = True):
        self.path, self.cores, self.torch_too = path, cores, torch_too
        self._busy = self._closed = False
        self.pid = os.getpid() if pid is None else pid
        size = self.SLOT.size * self.SLOTS
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # two workers starting at once never take the same slot
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
            self._mine = self._claim()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: the mapping holds a duplicate of fd, and with it the lock
            os.close(fd)

    def _claim(self) -> int:
        for i in range(self.SLOTS):
            pid, _ = self.SLOT.unpack_from(self._map, i * self.SLOT.size)
            if pid in (0, self.pid) or not _alive(pid):
                self.SLOT.pack_into(self._map, i * self.SLOT.size, self.pid, 0)
                return i * self.SLOT.size
        raise RuntimeError(f"{self.path}: all {self.SLOTS} slots are held by live processes; "
                           "set KVSERVE_THREAD_BUDGET=fixed for this many workers on one host")

    def threads_for_step(self) -> int:
        """Marks this worker as having work; returns the threads its next step may use."""
        if self._closed:
            return 1
        self._mark(True)
        busy = 0
        for i in range(self.SLOTS):
            pid, has_work = self.SLOT.unpack_from(self._map, i * self.SLOT.size)
            busy += bool(pid and has_work and (pid == self.pid or _alive(pid)))
        return max(1, self.cores // busy)

    def idle(self) -> None:
        """This worker has nothing to step: the others may take its cores."""
        self._mark(False)

    def _mark(self, busy: bool) -> None:
        if busy != self._busy and not self._closed:
            self.SLOT.pack_into(self._map, self._mine, self.pid, int(busy))
            self._busy = busy

    def apply(self) -> int:
        n = self.threads_for_step()
        if self.torch_too and n != torch.get_num_threads():
            torch.set_num_threads(n)
        if native.fused_available() and n != native.threads():
            native.set_threads(n)
        return n

    def close(self) -> None:
        """Gives the slot back (a dead process's slot is taken over anyway); the last live worker of the host
        removes the file."""
        if self._closed:
            return
        self.SLOT.pack_into(self._map, self._mine, 0, 0)
        self._closed = True
        self._map.close()
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # no worker claims a slot while we look
            data = os.read(fd, self.SLOT.size * self.SLOTS)
            pids = [self.SLOT.unpack_from(data, i * self.SLOT.size)[0] for i in range(len(data) // self.SLOT.size)]
            if not any(pid and _alive(pid) for pid in pids):
                os.unlink(self.path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def core_budget_for(role: str, prefix: str, env=None) -> CoreBudget | None:
    """The host's shared budget for a worker, or None where threads stay fixed: KVSERVE_TORCH_THREADS
    set, KVSERVE_THREAD_BUDGET=fixed, a single core or a process that is not a worker. `lend` moves the native
    kernels' threads only, `shared` torch's too."""
    env = os.environ if env is None else env
    mode = thread_budget_setting(env)
    cores = os.cpu_count() or 1
    if mode == "fixed" or role not in WORKER_ROLES or cores < 2 or env.get("KVSERVE_TORCH_THREADS", "").strip():
        return None
    return CoreBudget(budget_path(prefix), cores, torch_too=mode == "shared")


def budget_path(prefix: str) -> Path:
    """The budget file the workers of one deployment (key prefix) on this host share."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"kvserve-cores-{os.getuid()}-{prefix}"
