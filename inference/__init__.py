"""kvserve's inference engine: a Llama-family model on a paged, ownership-guarded KV cache.

This package never imports Django: Celery tasks and Django services call into it.

Importing it sets the OpenMP spin before torch loads (`openmp_spin_default`), so it is imported first by every
process that computes: the Django project (kvserve/__init__.py, which Celery workers load first) and bench/.
"""
import os
import sys

# GOMP_SPINCOUNT's value here: ~10-30 us of spinning, then the thread sleeps (libgomp's own default, 300,000, is
# ~1 ms). bench/RESULTS.md, stop 45.
OPENMP_SPINCOUNT = "10000"


def openmp_spin_default(env=os.environ) -> bool:
    """Shortens how long torch's idle OpenMP threads spin after each parallel region, unless the operator set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT; True when it set it. Between a oneDNN / ATen op and the next native kernel
    those threads otherwise spin ~1 ms on the cores the native kernels' helpers need (inference/native/pool.cpp),
    and a kernel meant for every core runs on one: on 2 cores a w4a8 prefill 1.3x, 32 decoding sequences 1.7x
    slower. libgomp reads the variable when it loads, with torch: too late once torch is imported (says so)."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return False
    env["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
    if "torch" in sys.modules:
        sys.stderr.write("kvserve: GOMP_SPINCOUNT set after torch loaded: it takes effect in child processes "
                         "only; import inference (or kvserve) before torch\n")
    return True


openmp_spin_default()
