"""The worker's engine start (kvserve.worker_boot.worker_started, Celery's worker_init hook) in a real
process: a configuration the engine refuses stops the worker with exit 3 and the operator's fix, instead
of a worker that consumes its queue without an engine (Celery swallows a hook's exceptions)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
START = "import django; django.setup(); from kvserve.worker_boot import worker_started; worker_started('t@h')"


def start_worker(tmp_path, tiny_paths, prefix, **env):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "kvserve.settings", "KVSERVE_ROLE": "decode",
           "KVSERVE_MODEL": str(tiny_paths["gguf"]), "KVSERVE_DEVICE": "cpu", "KVSERVE_NUM_PAGES": "64",
           "KVSERVE_WINDOW": "1024", "REDIS_URL": TEST_REDIS_URL, "KVSERVE_LEDGER_PREFIX": prefix,
           "KVSERVE_SECRETS_FILE": str(tmp_path / "secrets.json"), "KVSERVE_CACHE_DIR": str(tmp_path / "cache"),
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", **env}
    return subprocess.run([sys.executable, "-c", START], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(240)
def test_scrub_off_without_the_fault_refuses_to_start(tmp_path, tiny_paths, registry_prefix, registry):
    refused = start_worker(tmp_path, tiny_paths, registry_prefix, KVSERVE_SCRUB="off", KVSERVE_FAULTS="")
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert "refusing to start the decode worker" in refused.stderr and "KVSERVE_FAULTS=no_scrub" in refused.stderr
    assert registry.live_workers() == []
    meant = start_worker(tmp_path, tiny_paths, registry_prefix, KVSERVE_SCRUB="off", KVSERVE_FAULTS="no_scrub")
    assert meant.returncode == 0, meant.stderr[-3000:]
    (worker,) = registry.live_workers()
    assert worker.scrub_policy == "off" and worker.faults == ["no_scrub"]


@pytest.mark.timeout(240)
def test_a_malformed_model_side_setting_refuses_before_the_runtime_starts(tmp_path, tiny_paths, registry_prefix,
                                                                         registry):
    refused = start_worker(tmp_path, tiny_paths, registry_prefix, KVSERVE_CPU_GEMM="fastest")
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert "refusing to start the decode worker: KVSERVE_CPU_GEMM='fastest' is not valid" in refused.stderr
    assert "torch intra-op threads" not in refused.stderr  # checked before threads, model and engine
    assert registry.live_workers() == []
