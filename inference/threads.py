"""How many torch intra-op threads this process uses (`KVSERVE_TORCH_THREADS`), set once at start.

Workers sharing a host must not oversubscribe its cores: an OpenMP op waits at its barrier for
every one of its threads, so a thread descheduled by another process's threads stalls the whole op.
Defaults: a prefill or decode worker takes half the host's cores (at least one), since `make run`
puts one of each on the same host; anything else (the CLI, benchmarks) takes every core.
"""
import logging
import os

import torch

from inference.settings import env_int

log = logging.getLogger(__name__)

WORKER_ROLES = ("prefill", "decode")


def torch_threads_for(role: str | None = None, env=None) -> int:
    cores = os.cpu_count() or 1
    n = env_int("KVSERVE_TORCH_THREADS", None, low=1, env=env)  # threads per process
    if n is not None:
        return n
    return max(1, cores // 2) if role in WORKER_ROLES else cores


def torch_threads_apply(role: str | None = None) -> int:
    """Sets torch's intra-op thread count for this process; returns it."""
    n = torch_threads_for(role)
    torch.set_num_threads(n)
    log.info("torch intra-op threads: %d (%s role, %d cores; KVSERVE_TORCH_THREADS overrides)",
             n, role or "no", os.cpu_count() or 1)
    return n
