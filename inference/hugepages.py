"""Large CPU tensors on transparent huge pages (2 MB): the KV pool's memory (inference.kv_cache).

Each decode step reads every live sequence's pages, scattered over the whole pool: on 4 KB pages nearly every 6 KB
run of K or V rows is a TLB miss (a 4 KB page's entry covers less than one such run), on 2 MB pages one entry covers
hundreds of them. Linux gives an anonymous mapping huge pages where the process asks (MADV_HUGEPAGE) and THP is
`madvise` or `always` (/sys/kernel/mm/transparent_hugepage/enabled); elsewhere this is plain memory.
"""
import logging
import math
import mmap
import re

import torch

log = logging.getLogger(__name__)

HUGE = 2 << 20
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The kernel's THP setting (always | madvise | never), or "" where it has none."""
    try:
        text = open(THP_ENABLED).read()
    except OSError:
        return ""
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else ""


def huge_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor of `shape` on a private anonymous mapping advised for huge pages (falls back to
    torch.zeros under 2 MB or without mmap's MADV_HUGEPAGE). The mapping lives as long as the tensor's storage."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE or advice is None or thp_mode() not in ("always", "madvise"):
        return torch.zeros(shape, dtype=dtype)
    # one huge page more than needed, so that the tensor can start on a 2 MB boundary: every 2 MB of it can be huge
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError as e:  # a kernel without THP: plain pages, same bytes
        log.info("KV pool: no huge pages (madvise: %s)", e)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE
    return raw[skip:skip + nbytes].view(dtype).view(shape)  # zero: a fresh anonymous mapping


def huge_share(t: torch.Tensor) -> float:
    """The share of the resident bytes of the mapping holding `t` that the kernel backs with huge pages now
    (/proc/self/smaps; neighbouring mappings alike may have merged into it), 0.0 where unknown."""
    addr = t.data_ptr()
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return 0.0
    inside, rss = False, 0
    for line in lines:
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= addr < int(head.group(2), 16)
        elif inside and line.startswith("Rss:"):
            rss = int(line.split()[1])
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / rss if rss else 0.0
    return 0.0
