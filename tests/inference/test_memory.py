"""inference.memory: what a serving process keeps per GEMM shape stays bounded, however many shapes it runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference.memory import GEMM_CACHE_VARIABLES, MALLOC_ARENAS, process_env

ROOT = Path(__file__).resolve().parents[2]
# a fresh process (oneDNN reads its cache capacity once): the model module's prepacked inner product run on
# 700 token counts, each a shape seen once; what glibc reports in use before and after
SHAPES = """
import ctypes, json, torch
from inference.precision import _onednn_linear

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
in_use = lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())
torch.set_num_threads(1)
w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 64), 32)
_onednn_linear(torch.randn(4, 64), w)
before = in_use()
for rows in range(1000, 1700):
    _onednn_linear(torch.randn(rows, 64), w)
print(json.dumps({"grew_mb": (in_use() - before) / 2**20}))
"""


def glibc_mallinfo2() -> bool:
    try:
        import ctypes

        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not glibc_mallinfo2(),
                    reason="needs a torch with oneDNN and glibc >= 2.33")
def test_the_prepacked_gemm_keeps_a_bounded_number_of_shapes():
    env = {k: v for k, v in os.environ.items() if k not in GEMM_CACHE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", SHAPES], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    grew = json.loads(out.stdout.strip().splitlines()[-1])["grew_mb"]
    # 700 shapes of ~0.4 MB each: ~330 MB when every one is kept (oneDNN's default 1,024), ~30 MB at 64
    assert grew < 180, f"the heap grew {grew:.0f} MB over 700 GEMM shapes"


# eight threads alive together that each allocate and keep heap chunks, then glibc's own account of its arenas (on stderr)
ARENAS = """
import ctypes, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
kept, together = [], threading.Barrier(8)
def work():
    together.wait()  # all alive at once: none takes over the arena of one that ended
    kept.extend(libc.malloc(64 * 1024) for _ in range(16))
    together.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.malloc_stats()
"""


def arenas_used(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", ARENAS], env=env, capture_output=True, text=True, timeout=60, check=True)
    return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


@pytest.mark.skipif(not glibc_mallinfo2(), reason="needs glibc")
def test_kvserve_processes_start_with_a_bounded_number_of_malloc_arenas():
    plain = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert process_env(plain)["MALLOC_ARENA_MAX"] == str(MALLOC_ARENAS)
    assert process_env({**plain, "MALLOC_ARENA_MAX": "4"})["MALLOC_ARENA_MAX"] == "4"  # the operator's own
    assert arenas_used(process_env(plain)) <= MALLOC_ARENAS < arenas_used(plain)
