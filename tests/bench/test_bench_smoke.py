"""Smoke test of the benchmark harness: `python -m bench.guards --quick` runs end to end against the
real model and Redis (DB 15, its own key prefix) and ends with one JSON line holding the figures
`bench.all` collects. No timing assertions: this machine is shared and noisy."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ("ratio_guards_on_vs_off", "ratio_scrub_on_vs_off", "ledger_allocate_p50_us", "ledger_allocate_p99_us",
            "ledger_free_p50_us", "ledger_free_p99_us")


def test_guards_quick_ends_with_one_json_line():
    proc = subprocess.run([sys.executable, "-m", "bench.guards", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    missing = [k for k in REQUIRED if k not in result]
    assert not missing, f"missing {missing} in {last}"
    for key in REQUIRED:
        assert isinstance(result[key], (int, float)) and result[key] > 0, (key, result[key])
    assert result["ledger_allocate_p50_us"] <= result["ledger_allocate_p99_us"]
    assert result["ledger_free_p50_us"] <= result["ledger_free_p99_us"]
    assert result["outputs_match"] is True
