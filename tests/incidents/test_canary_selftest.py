"""The detector self-test: the incident replayed in a sandbox must leak with every guard off, and each guard
switched back on alone must stop it (inference.sandbox, incidents.canary.selftest). No stack, no Redis."""
import pytest

from inference import handoff, sandbox
from inference.block_manager import BlockManager
from inference.faults import Faults
from inference.sandbox import ALL_FAULTS, IncidentReplay, audit_read_record, sentinel_seen
from incidents.canary import selftest
from incidents.canary.selftest import check_selftest


@pytest.fixture(scope="module")
def replay(real_model):
    r = IncidentReplay(real_model, sentinel="K7Q-B2X-M9T")
    r.setup()
    return r


def test_previous_request_leaves_its_kv_in_the_whole_reserved_pool(replay):
    prev = replay.previous
    assert prev["pages"] == list(range(8))  # it reserved the whole decode pool
    assert prev["sentinel_echoed"], prev["text"]
    written = [p for p, w in zip(prev["pages"], prev["written"]) if w]
    assert set(prev["checksums"]) == set(written) and len(written) >= 4
    assert replay.free_pages() == {"prefill": 4, "decode": 8}


def test_every_guard_off_reproduces_the_leak(replay):
    o = replay.run(ALL_FAULTS, "all_guards_off")
    assert o.stopped_by is None and o.status == "finished" and o.output_tokens == 4  # a 200 OK, in the incident's words
    assert o.handoff == {"verdict": "REJECTED", "expected_tokens": 124, "transferred_tokens": 1, "num_pages": 1}
    assert o.pages_taken == {"decode": 8}
    rec = o.read_record
    assert rec["pages"] == list(range(8)) and rec["read_len"] == 124 and sum(rec["written"]) == 1
    # pages 1.. still hold the previous request's prompt and answer, byte for byte; page 0 got the placeholder
    assert o.stale_pages and 0 not in o.stale_pages
    assert set(o.stale_pages) <= set(replay.previous["checksums"])
    assert {"kind": "unwritten_read", "read_len": 124, "written": 1} in o.audit
    assert o.leaked
    assert replay.free_pages() == {"prefill": 4, "decode": 8}


@pytest.mark.parametrize("scenario, faults, variant, stopped_by, kind", [
    ("admission_on", ALL_FAULTS - {"no_admission"}, "reserve", "admission", "context_length_exceeded"),
    ("handoff_check_on", ALL_FAULTS - {"no_handoff_check"}, "reserve", "handoff", "rejected"),
    ("read_guard_on", ALL_FAULTS - {"no_ownership_guard", "no_watermark_guard"}, "reserve", "guard", "unwritten_read"),
    ("watermark_guard_on", ALL_FAULTS - {"no_watermark_guard"}, "reserve", "guard", "unwritten_read"),
    ("ownership_guard_on", ALL_FAULTS - {"no_ownership_guard"}, "stale_table", "guard", "stale_epoch"),
])
def test_each_guard_alone_stops_it(replay, scenario, faults, variant, stopped_by, kind):
    o = replay.run(Faults(faults), scenario, variant)
    assert (o.stopped_by, o.refusal_kind) == (stopped_by, kind), o.to_dict()
    assert not o.leaked and o.output_tokens == 0 and o.output_text == ""
    if stopped_by == "admission":
        assert o.handoff is None and o.pages_taken == {}  # refused before prefill reserved anything
    if stopped_by == "handoff":
        assert o.handoff["verdict"] == "REJECTED" and "decode" not in o.pages_taken  # before decode reserved
    assert replay.free_pages() == {"prefill": 4, "decode": 8}
    # the stale pages were there to be read: the guard, not luck, stopped it
    if stopped_by == "guard":
        assert o.stale_pages


def test_check_selftest_passes_and_describes_the_observable(real_model):
    result = check_selftest(real_model)
    assert result.passed, result.details
    obs = result.details["observable"]
    assert obs["leak_reproduced"] and obs["stale_pages"] and obs["completed_silently"]
    assert obs["read_len"] > obs["written_for_reader"]
    assert set(result.details["scenarios"]) == set(selftest.SCENARIOS)
    assert all(s["ok"] for s in result.details["scenarios"].values())
    assert result.incidents == []


def test_broken_read_guard_fails_the_selftest(tiny_model, monkeypatch):
    monkeypatch.setattr(BlockManager, "check_reads", lambda self, seq, num_past, num_new: None)
    result = check_selftest(tiny_model)
    assert not result.passed
    failed = {n for n, s in result.details["scenarios"].items() if not s["ok"]}
    assert failed == {"read_guard_on", "watermark_guard_on", "ownership_guard_on"}
    assert {i.kind for i in result.incidents} == {"unwritten_read", "stale_epoch"}
    assert all(i.worker == "" for i in result.incidents)  # a sandbox: nobody live to quarantine


def test_broken_handoff_check_fails_the_selftest(tiny_model, monkeypatch):
    monkeypatch.setattr(handoff, "_check_contract", lambda *a, **k: None)  # the one rule, broken
    result = check_selftest(tiny_model)
    assert not result.passed
    assert {n for n, s in result.details["scenarios"].items() if not s["ok"]} == {"handoff_check_on"}
    assert [i.kind for i in result.incidents] == ["handoff_mismatch"]


def test_scrubbed_pages_mean_no_leak_to_see_and_the_selftest_fails(tiny_model, monkeypatch):
    """If the sandbox cannot make the leak happen, the detectors are unproven: 'detectors broken'."""
    real_init = BlockManager.__init__

    def scrubbing(self, allocator, pool, scrub_policy="on_free", faults=Faults()):
        real_init(self, allocator, pool, "on_free", Faults(set(faults) - {"no_scrub"}))
    monkeypatch.setattr(BlockManager, "__init__", scrubbing)
    result = check_selftest(tiny_model)
    assert not result.passed
    assert "detectors broken" in result.details["scenarios"]["all_guards_off"]["problem"]
    assert "canary_leak" in [i.kind for i in result.incidents]


def test_audit_and_sentinel_matching():
    ok = {"request": "r", "pages": [3, 4], "owners": ["r", "r"], "epochs": [7, 8], "page_epochs": [7, 8],
          "written": [16, 5], "read_len": 21}
    assert audit_read_record(ok) == []
    bad = {**ok, "owners": ["r", "x"], "page_epochs": [9, 8], "read_len": 30}
    kinds = [p["kind"] for p in audit_read_record(bad)]
    assert kinds == ["stale_epoch", "foreign_read", "unwritten_read"]
    assert sentinel_seen("the code is k7q b2x m9t!", "K7Q-B2X-M9T")
    assert sentinel_seen("...B2XM9T...", "K7Q-B2X-M9T")  # two consecutive groups are enough
    assert not sentinel_seen("K7Q and M9T", "K7Q-B2X-M9T")


SELFTEST_RUNS = """
import json, os, threading
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")
import django
django.setup()
from inference.loader import load_model
from inference.memory import process_memory
from incidents.canary.selftest import check_selftest
model = load_model()  # no engine holds a model built from it: every run's sandbox must build one
rows = []
for i in range(3):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", check_selftest(model)))  # as the suite runs a check
    t.start(); t.join()
    rows.append({"passed": out["r"].passed, **process_memory()})
print(json.dumps(rows))
"""


@pytest.mark.timeout(400)
def test_a_selftest_that_builds_its_own_model_hands_it_back():
    """In a fresh process (what `manage.py canary` runs, or a worker whose engine is not on the CPU) each run
    packs ~0.5 GB of model for its sandbox engines; freed and trimmed, the process's anonymous memory stays
    where the first run left it (without the release it grows ~0.9 GB a run)."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SELFTEST_RUNS], capture_output=True, text=True, timeout=400,
                         env={**os.environ, "KVSERVE_TORCH_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(r["passed"] for r in rows)
    anon = [r["RssAnon"] >> 20 for r in rows]
    assert max(anon) - anon[0] <= 100 and anon[0] < 1000, anon  # MB: no model's worth kept after a run
