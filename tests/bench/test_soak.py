"""bench.soak's short subset through real processes (its own redis-server, Celery prefill + decode workers, web,
beat): two tenants, streamed and not, client disconnects, Redis client connections killed, the canary on its
beat schedule; then the targets that must hold however short the run: nothing lost, no foreign sentinel,
no false critical incident, no page stranded after drain, every pool intact. (RSS growth is reported, not
asserted: a couple of minutes is no steady state.)"""
import json
import os
import subprocess
import sys

import pytest

from bench.soak import rss_growth, vm_rss_kb
from tests.e2e.stack import ROOT


def test_vm_rss_is_read_from_proc_and_growth_is_relative_to_warm_up():
    assert vm_rss_kb(os.getpid()) > 1000
    assert vm_rss_kb(2**22 + 7) is None  # no such process
    assert rss_growth({"a": 1000, "b": 200}, {"a": 1050, "b": None}) == {"a": 0.05, "b": None}


@pytest.mark.timeout(600)
def test_short_soak_meets_its_targets(tmp_path):
    # the tiny random-weight model: the soak measures serving, not text (bench.soak's default is the real model)
    cmd = [sys.executable, "-m", "bench.soak", "--model", "tiny", "--requests", "150", "--min-seconds", "10", "--seconds", "200",
           "--concurrency", "8", "--max-tokens", "4,8,16", "--kill-every-s", "3", "--canary-every-s", "8",
           "--canary-checks", "live_probes,marker,integrity", "--bound-s", "150", "--warmup", "15", "--workdir", str(tmp_path)]
    # --min-seconds 10: a fast CPU answered 150 requests in 6 s, before the second kill (every 3 s)
    # bound 150 s: under kills every 3 s a request was seen to end (failed) 95 s after submission on a loaded
    # machine; it did end, but the stated bound is the README's, not this test's (see the issue 20 note)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the soak closes its stack (workers, web, beat, redis-server) on the way out
        stdout, stderr = proc.communicate(timeout=120)
        pytest.fail(f"the soak ran past 420 s: {stderr[-3000:]}")
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert out.stdout.strip(), out.stderr[-4000:]
    f = json.loads(out.stdout.strip().splitlines()[-1])
    logs = out.stdout[-3000:] + out.stderr[-3000:]
    # the run exercised what it claims to
    assert f["requests"] >= 60 and f["done"] >= 0.6 * f["requests"], logs  # runs end ~95 % done, the rest disconnects
    assert f["redis_kills"] >= 2 and f["redis_connections_killed"] > 0, logs
    assert f["canary_runs"] >= 1 and f["disconnected"] >= 3 and 0 < f["streamed"] < f["requests"], logs
    # the targets
    assert f["lost"] == 0, f["lost_detail"]
    assert f["foreign_sightings"] == 0, f["foreign_detail"]
    assert f["false_critical_incidents"] == 0, f["critical_detail"]
    assert f["canary_wrong"] == [] and f["canary_checks"].get("passed", 0) >= 1, f["canary_checks"]
    assert f["stranded_pages"] == 0, f["stranded_detail"]
    assert f["integrity"] == "ok", f["integrity"]
    assert f["quarantined_at_end"] == [], logs
