"""inference/__init__.py's OpenMP spin: set before torch loads in every process that computes, as libgomp itself
reports it (OMP_DISPLAY_ENV), and never over the operator's own choice."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import inference

ROOT = Path(__file__).resolve().parents[2]


def libgomp_spincount(code: str, **env) -> tuple[str, str]:
    """GOMP_SPINCOUNT as libgomp read it at load in a fresh interpreter running `code`, and that one's stderr."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                         capture_output=True, text=True, timeout=120, check=True)
    lines = [line for line in out.stderr.splitlines() if line.strip().startswith("GOMP_SPINCOUNT =")]
    assert lines, out.stderr[-2000:]
    return lines[0].split("=", 1)[1].strip().strip("'"), out.stderr


def test_the_default_is_set_unless_the_operator_chose():
    env = {}
    assert inference.openmp_spin_default(env) is True
    assert env == {"GOMP_SPINCOUNT": inference.OPENMP_SPINCOUNT}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(chosen)
        assert inference.openmp_spin_default(env) is False
        assert env == chosen


@pytest.mark.parametrize("first", ["kvserve", "bench", "inference.engine"])
def test_every_entry_point_sets_it_before_torch_loads(first):
    # the Django project (Celery workers and the web server load it first), the benchmarks, the engine
    spin, stderr = libgomp_spincount(f"import {first}; import torch")
    assert spin == inference.OPENMP_SPINCOUNT
    assert "after torch loaded" not in stderr


def test_torch_first_keeps_libgomps_own_spin_and_an_operators_value_stands():
    spin, stderr = libgomp_spincount("import torch; import inference")
    assert spin == "300000"  # libgomp's default: what it replaces
    assert "GOMP_SPINCOUNT set after torch loaded" in stderr  # and the process says why it did not take
    assert libgomp_spincount("import kvserve; import torch", GOMP_SPINCOUNT="1234")[0] == "1234"
