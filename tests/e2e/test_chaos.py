"""The chaos suite's short subset (`python -m bench.chaos --quick`) on separate test hosts (network
namespaces, root): no fault, and a decode host cut off the network for twice the lease mid-stream. Every target must hold, and the run must leave no namespace, link, state file or process
behind. The full suite is `python -m bench.chaos` (README, "Chaos suite")."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.hosts import NETNS_PREFIX, list_links, list_netns

ROOT = Path(__file__).resolve().parents[2]
DETAIL = ("checks_failed", "failed_codes", "lost_detail", "critical_detail", "foreign_detail", "integrity",
          "served", "stranded_pages", "in_flight_at_fault")


@pytest.mark.timeout(900)
def test_quick_chaos_meets_every_target_and_cleans_up(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--quick", "--workdir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=840)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    assert last.startswith("{"), f"bench.chaos ended without its JSON line: {proc.stderr[-3000:]}"
    result = json.loads(last)
    assert set(result["scenarios"]) == {"control", "cut_decode"}, proc.stderr[-3000:]
    run = result["run"]
    assert result["cleanup_ok"] and result["leftovers"] == []
    assert not [n for n in list_netns() if n.startswith(f"{NETNS_PREFIX}{run}-")]
    assert not [link for link in list_links() if link.startswith(f"kch{run}")]
    failed = {name: {k: f[k] for k in DETAIL if f.get(k) not in (None, [], {}, "ok")}
              for name, f in result["scenarios"].items() if not f["passed"]}
    assert not failed, f"targets missed: {json.dumps(failed, indent=1)}; logs in {tmp_path / 'logs'}"
    assert result["passed"] and proc.returncode == 0
