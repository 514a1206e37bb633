"""A process's memory as the kernel counts it (/proc/<pid>/status), and handing freed heap back to it.

glibc keeps what a process frees in its malloc arenas (one per thread that allocates, up to 8 per core)
unless the chunk was mmapped, and its mmap threshold rises to the largest chunk freed (up to 32 MiB), so
the tensors of a short-lived engine stay in RSS after they are gone. `release_freed_memory` collects
Python's cycles and asks glibc to return every arena's free pages (`malloc_trim(0)`)."""
import ctypes
import ctypes.util
import gc
import os

FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def process_memory(pid: int | None = None) -> dict[str, int]:
    """Bytes, by /proc/<pid>/status field (VmRSS = RssAnon + RssFile + RssShmem; VmHWM: peak RSS)."""
    out = {}
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) * 1024
    return out


def rss_bytes(pid: int | None = None) -> int:
    return process_memory(pid)["VmRSS"]


def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


_LIBC = _libc()


def release_freed_memory() -> bool:
    """Collects Python garbage and returns free malloc pages to the kernel; False where libc has no
    malloc_trim (not glibc), in which case only the collection ran."""
    gc.collect()
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


def malloc_arena_max() -> int | None:
    """MALLOC_ARENA_MAX as this process was started with (glibc reads it once, at start), or None."""
    raw = os.environ.get("MALLOC_ARENA_MAX", "").strip()
    return int(raw) if raw.isdigit() else None
