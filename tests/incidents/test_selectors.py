"""The dashboard's canary summary: live probe results per worker and probe."""
import pytest
from django.utils import timezone

from incidents.models import CanaryRun
from incidents.selectors import canary_latest_get

pytestmark = pytest.mark.django_db


def test_the_latest_canary_lists_each_workers_probe_results():
    details = {"workers": {"decode-1": {"checks": {"guard": {"ok": True}, "scrub": {"ok": False}, "handoff": {"ok": True}}},
                           "prefill-1": {"checks": {"guard": {"ok": True}, "scrub": {"ok": True}}}}}
    CanaryRun.objects.create(started_at=timezone.now(), passed=False,
                             checks=[{"name": "live_probes", "passed": False, "details": details},
                                     {"name": "integrity", "passed": True, "details": {"pools": {}}}])
    checks = {c["name"]: c for c in canary_latest_get()["checks"]}
    assert checks["live_probes"]["per_worker"] == {"decode-1": {"guard": "passed", "scrub": "wrong", "handoff": "passed"},
                                                   "prefill-1": {"guard": "passed", "scrub": "passed"}}
    assert checks["integrity"]["per_worker"] == {}


def test_a_probe_not_judged_shows_as_such_not_as_a_failure():
    details = {"workers": {"decode-1": {"checks": {"guard": {"ok": True, "outcome": "passed"},
                                                   "handoff": {"ok": False, "outcome": "not_judged"}}}}}
    CanaryRun.objects.create(started_at=timezone.now(), passed=False,
                             checks=[{"name": "live_probes", "passed": False, "outcome": "not_judged", "details": details}])
    latest = canary_latest_get()
    assert latest["outcome"] == "not_judged" and latest["checks"][0]["outcome"] == "not_judged"
    assert latest["checks"][0]["per_worker"] == {"decode-1": {"guard": "passed", "handoff": "not_judged"}}
