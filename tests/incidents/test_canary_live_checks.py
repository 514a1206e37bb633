"""Canary checks that need live registrations but no engine: handoff contract (against inference.handoff.handoff_accept and
RedisTransport, real Redis DB 15), ledger integrity, worker configuration, and the reproduction test's
admission probe (a refused request never reaches a worker). Each failing check records an incident and a
critical one quarantines the worker."""
import pytest
from django.conf import settings

from incidents.canary import reproduction
from inference import handoff
from incidents.canary.handoff_contract import check_handoff_contract
from incidents.canary.integrity import check_integrity, check_worker_config
from incidents.canary.prompts import TENANT_B
from incidents.canary.reproduction import check_reproduction
from incidents.canary.suite import canary_run
from incidents.models import Incident
from inference.registry import Registry
from kvserve.chat.models import ChatRequest
from tests.incidents.helpers import live_worker

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]
KEY = b"canary-test-handoff-key"


@pytest.fixture
def broker(settings, registry_prefix):
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS,
                                                "global_keyprefix": f"{registry_prefix}:broker:"}
    return f"{registry_prefix}:broker:"


@pytest.fixture
def workers(registry, make_worker):
    prefill = live_worker(registry, make_worker, "prefill", worker_id="prefill-ok", num_pages=512, capacity_tokens=8192)
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-ok", num_pages=512, capacity_tokens=8192)
    return prefill, decode


# ---- handoff contract -------------------------------------------------------------------------

def test_handoff_contract_refuses_each_bad_handoff_with_its_kind(workers, registry_redis, registry_prefix):
    result = check_handoff_contract(key=KEY)
    assert result.passed, result.details
    cases = result.details["workers"]["decode-ok"]["cases"]
    assert {c: r["got"] for c, r in cases.items()} == {
        "valid": "accepted", "rejected": "rejected", "truncated": "handoff_mismatch",
        "bad_checksum": "handoff_mismatch", "bad_signature": "handoff_forged", "stale_epoch": "stale_epoch",
        "wrong_request": "handoff_mismatch", "blob_dtype": "handoff_mismatch"}
    assert not list(registry_redis.scan_iter(match=f"{registry_prefix}:kv:*"))  # every canary blob cleaned up


def test_handoff_contract_fails_for_a_decode_worker_without_the_check(workers, registry, make_worker):
    live_worker(registry, make_worker, "decode", worker_id="decode-nocheck", faults=["no_handoff_check"])
    result = check_handoff_contract(key=KEY)
    assert not result.passed
    cases = result.details["workers"]["decode-nocheck"]["cases"]
    assert {c for c, r in cases.items() if not r["ok"]} == {"rejected", "truncated", "bad_signature", "wrong_request"}
    # the blob's own checks (epoch fence, signed shape/dtype, checksums) run even with the contract off
    assert cases["bad_checksum"]["ok"] and cases["stale_epoch"]["ok"] and cases["blob_dtype"]["ok"]
    assert [(i.kind, i.worker, i.severity) for i in result.incidents] == [
        ("handoff_mismatch", "decode-nocheck", "critical")]


def test_a_broken_acceptance_rule_fails_the_contract(workers, monkeypatch):
    monkeypatch.setattr(handoff, "_check_contract", lambda *a, **k: None)
    result = check_handoff_contract(key=KEY)
    assert not result.passed and result.incidents[0].worker == "decode-ok"


def test_handoff_contract_without_decode_workers_is_vacuous_not_passing(registry, make_worker):
    live_worker(registry, make_worker, "prefill", worker_id="prefill-only")
    result = check_handoff_contract(key=KEY)
    assert not result.passed and result.details["reason"].startswith("vacuous")
    assert [(i.kind, i.severity, i.worker) for i in result.incidents] == [("canary_leak", "warning", "")]


def test_failed_contract_writes_an_incident_and_quarantines_the_decode_worker(workers, registry, make_worker):
    live_worker(registry, make_worker, "decode", worker_id="decode-nocheck", faults=["no_handoff_check"])
    run = canary_run(checks={"handoff_contract": lambda: check_handoff_contract(key=KEY)})
    assert not run.passed and run.checks[0]["name"] == "handoff_contract"
    incident = Incident.objects.get(pk=run.checks[0]["details"]["incidents"][0])
    assert (incident.kind, incident.worker, incident.detected_by) == (
        "handoff_mismatch", "decode-nocheck", "canary handoff_contract")
    assert incident.quarantined and registry.is_quarantined("decode-nocheck")
    assert not registry.is_quarantined("decode-ok")
    # a second run while the worker stays broken and quarantined reuses the open incident
    again = canary_run(checks={"handoff_contract": lambda: check_handoff_contract(key=KEY)})
    assert again.checks[0]["details"]["incidents"] == [incident.pk]


# ---- integrity and worker configuration --------------------------------------------------------

def test_integrity_of_live_pools_only(workers, registry, registry_redis, registry_prefix):
    prefill, decode = workers
    decode.allocate("req-1", 3)
    from inference.ledger import RedisLedger
    RedisLedger.register(registry_redis, "dead-worker", "decode", 8, 16, prefix=registry_prefix)  # pool, no worker
    result = check_integrity()
    assert result.passed, result.details
    assert set(result.details["pools"]) == {"prefill-ok", "decode-ok"} and result.details["not_live"] == ["dead-worker"]


def test_broken_books_fail_integrity_and_quarantine(workers, registry, registry_redis):
    prefill, decode = workers
    registry_redis.rpush(decode.key("free"), 0)  # page 0 on the free list twice
    run = canary_run(checks={"integrity": check_integrity})
    assert not run.passed
    incident = Incident.objects.get(kind="integrity")
    assert incident.worker == "decode-ok" and incident.quarantined and registry.is_quarantined("decode-ok")
    assert run.checks[0]["details"]["pools"]["prefill-ok"]["ok"]


@pytest.mark.parametrize("fault", ["no_ownership_guard", "no_watermark_guard", "no_scrub", "no_admission",
                                   "no_handoff_check", "placeholder_on_reject"])
def test_worker_config_flags_every_fault(workers, registry, make_worker, fault):
    live_worker(registry, make_worker, "decode", worker_id="decode-faulty", faults=[fault])
    result = check_worker_config()
    assert not result.passed
    assert [(i.kind, i.worker) for i in result.incidents] == [("config_unsafe", "decode-faulty")]
    assert f"fault injection active: {fault}" in result.details["workers"]["decode-faulty"]["problems"]


def test_worker_config_flags_window_over_pool_and_passes_when_safe(workers, registry, make_worker):
    assert check_worker_config().passed
    live_worker(registry, make_worker, "prefill", worker_id="prefill-small", num_pages=8, capacity_tokens=128,
                window=8192)
    result = check_worker_config()
    assert not result.passed and result.incidents[0].worker == "prefill-small"
    assert "window 8192 > pool capacity 128 tokens" in result.details["workers"]["prefill-small"]["problems"]


# ---- reproduction -----------------------------------------------------------------------------

def test_reproduction_refuses_the_incident_prompt_before_anything(registry, make_worker, broker, registry_redis):
    # the incident's shape in miniature: window 2048, the decode pool holds only 1024 tokens
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1", num_pages=256, capacity_tokens=4096, window=2048)
    live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=64, capacity_tokens=1024, window=2048)
    registry_redis.lpush(f"{broker}prefill", "{}")  # a queue that is not empty: its length must not change
    result = check_reproduction()
    assert result.passed, result.details
    d = result.details
    assert d["limit"] == 1024 and d["shape"].startswith("within the window")
    assert 1024 < d["prompt_tokens"] < 2048
    assert d["refusal"]["status"] == 400 and d["refusal"]["code"] == "context_length_exceeded"
    assert d["queues_before"] == d["queues_after"] and d["queues_after"]["prefill"] == 1
    assert all(p["unchanged"] for p in d["pools"].values()) and set(d["pools"]) == {"prefill-1", "decode-1"}
    assert not ChatRequest.objects.exists()


@pytest.mark.django_db(transaction=True)  # canary_run runs the check in a thread of its own
def test_reproduction_fails_when_admission_lets_it_through(workers, broker, monkeypatch):
    # the API's admission is broken (sees no real limit); the canary still knows the deployment's limit
    monkeypatch.setattr(Registry, "effective_limit", lambda self: 10**6)
    monkeypatch.setattr(reproduction, "registry_get", lambda: _FixedLimit(8192))
    run = canary_run(checks={"reproduction": lambda: check_reproduction(settle_s=0)})
    assert not run.passed
    d = run.checks[0]["details"]
    assert d["refusal"] is None and len(d["rows"]) == 1
    assert ChatRequest.objects.get(id=d["rows"][0]).tenant.name == TENANT_B
    incident = Incident.objects.get(pk=d["incidents"][0])
    assert incident.kind == "config_unsafe" and incident.detected_by == "canary reproduction"
    assert incident.worker == ""  # no worker took it (yet): the API's admission is what failed


@pytest.mark.django_db(transaction=True)  # canary_run runs the check in a thread of its own
def test_reproduction_quarantines_a_worker_that_served_the_overlong_prompt(workers, broker, monkeypatch, registry):
    monkeypatch.setattr(Registry, "effective_limit", lambda self: 10**6)
    monkeypatch.setattr(reproduction, "registry_get", lambda: _FixedLimit(8192))
    real_settled = reproduction._settled

    def prefill_took_it(rid, wait_s):  # what a prefill worker whose re-check is broken would leave behind
        ChatRequest.objects.filter(id=rid).update(status="decoding", handoff_verdict="OK", prefill_worker="prefill-ok")
        return real_settled(rid, 0)
    monkeypatch.setattr(reproduction, "_settled", prefill_took_it)
    run = canary_run(checks={"reproduction": lambda: check_reproduction(settle_s=0)})
    assert not run.passed
    incident = Incident.objects.get(worker="prefill-ok")
    assert incident.kind == "config_unsafe" and incident.quarantined and registry.is_quarantined("prefill-ok")


class _FixedLimit:
    def __init__(self, limit):
        self.limit = limit

    def effective_limit(self):
        return self.limit


def test_reproduction_without_workers_is_vacuous(registry):
    result = check_reproduction()
    assert not result.passed and "vacuous" in result.details["reason"]


def test_canary_settings_exist():
    assert settings.KVSERVE_CANARY_TIMEOUT_S > 0 and settings.KVSERVE_CANARY_LOCK_S > 0


# ---- live probes (the probes themselves run in real workers: tests/e2e/test_canary.py) -----------------

def test_live_probes_fail_for_workers_they_cannot_reach_naming_each(registry, make_worker):
    from incidents.canary.probes import check_live_probes

    live_worker(registry, make_worker, "prefill", worker_id="prefill-nodq")  # registered without a direct queue
    live_worker(registry, make_worker, "decode", worker_id="decode-nodq")
    result = check_live_probes(wait_s=1, key=KEY)
    assert not result.passed
    workers = result.details["workers"]
    assert workers["prefill-nodq"]["failed"] == ["guard", "scrub"]
    assert workers["decode-nodq"]["failed"] == ["guard", "scrub", "handoff"]
    assert all(c["reason"].startswith("unreachable") for w in workers.values() for c in w["checks"].values())
    assert {(i.worker, i.severity) for i in result.incidents} == {("prefill-nodq", "warning"), ("decode-nodq", "warning")}
    assert result.outcome == "not_judged" and {w["outcome"] for w in workers.values()} == {"not_judged"}


def test_live_probes_without_serving_workers_are_vacuous(registry, make_worker):
    from incidents.canary.probes import check_live_probes

    live_worker(registry, make_worker, "prefill", worker_id="prefill-alone")
    result = check_live_probes(wait_s=1, key=KEY)
    assert not result.passed and result.details["reason"].startswith("vacuous")


# ---- live probe outcomes: passed, wrong (the worker answered wrongly), not judged (it did not answer) --------

def probe_row(status, decode_worker="decode-w1", **fields) -> ChatRequest:
    return ChatRequest(id="canary-probe-x", status=status, decode_worker=decode_worker, **fields)


S = ChatRequest.Status
REFUSED = dict(error_code="handoff_refused", decode_verdict="handoff_mismatch")


@pytest.mark.parametrize("case, row, events, record, outcome", [
    # never taken (every Celery thread busy): no answer, no verdict
    ("truncated", probe_row(S.PREFILLING, decode_worker=""), [], {}, "not_judged"),
    ("valid", probe_row(S.PREFILLING, decode_worker=""), [], {}, "not_judged"),
    ("valid", None, [], {}, "not_judged"),
    # taken and still running at the deadline (the valid one waits for pages)
    ("valid", probe_row(S.DECODING), [], {}, "not_judged"),
    ("truncated", probe_row(S.DECODING), [], {}, "not_judged"),
    ("valid", probe_row(S.FAILED, error_code="timeout", decode_verdict="accepted"), ["error"], {}, "not_judged"),
    # its KV gone from the transport (a take whose reply was lost): no verdict on the handoff
    ("valid", probe_row(S.FAILED, error_code="handoff_refused", decode_verdict="kv_missing"), ["error"], {},
     "not_judged"),
    # answered as it must be
    ("valid", probe_row(S.DONE, completion_tokens=3), ["delta", "done"], {}, "passed"),
    ("truncated", probe_row(S.FAILED, **REFUSED), ["error"],
     {"worker": "decode-w1", "refused": "handoff_mismatch"}, "passed"),
    # answered wrongly: accepted a bad handoff, produced content for it, refused the valid one
    ("truncated", probe_row(S.DONE, completion_tokens=3, decode_verdict="accepted"), ["delta", "done"], {}, "wrong"),
    ("truncated", probe_row(S.DECODING), ["delta"], {}, "wrong"),
    ("truncated", probe_row(S.FAILED, error_code="timeout", decode_verdict="accepted"), ["error"], {}, "wrong"),
    ("valid", probe_row(S.FAILED, error_code="handoff_refused", decode_verdict="handoff_mismatch"), ["error"], {},
     "wrong"),
    ("other_key", probe_row(S.FAILED, **REFUSED), ["error"], {"worker": "decode-w1", "refused": "handoff_mismatch"},
     "wrong"),
])
def test_a_handoff_probe_is_wrong_only_where_the_worker_answered_wrongly(case, row, events, record, outcome):
    from incidents.canary.probes import _handoff_outcome

    assert _handoff_outcome(case, row, events, record, "decode-w1")[0] == outcome


@pytest.mark.parametrize("record, outcome", [
    (None, "not_judged"),
    ({"ok": False, "worker": "w1", "reason": "busy: no free pages for the guard probe now"}, "not_judged"),
    ({"ok": False, "worker": "w1", "reason": "timed out: the engine loop did not run the probe in time"}, "not_judged"),
    ({"ok": True, "worker": "w1"}, "passed"),
    ({"ok": True, "worker": "another"}, "wrong"),
    ({"ok": False, "worker": "w1", "cases": {"foreign_page": {"got": "allowed"}}}, "wrong"),
    ({"ok": False, "worker": "w1", "reason": "page 3 still holds 12 nonzero values after its free"}, "wrong"),
])
def test_a_guard_or_scrub_probe_without_an_answer_is_not_judged(record, outcome):
    from incidents.canary.probes import _probe_outcome

    assert _probe_outcome(record, "w1", True, 30)["outcome"] == outcome


@pytest.mark.parametrize("rows, records, answered", [
    ({"h1": ("decoding", "")}, {"g1": {}}, False),  # a handoff still decoding
    ({"h1": ("failed", "handoff_refused")}, {"g1": {}}, False),  # refused and failed closed, record not yet written
    ({"h1": ("failed", "handoff_refused")}, {"g1": {}, "h1": {"refused": "handoff_mismatch"}}, True),
    ({"h1": ("done", "")}, {"g1": {}}, True),  # accepted: no record to wait for
    ({"h1": ("failed", "timeout")}, {"g1": {}}, True),
    ({"h1": ("done", "")}, {}, False),  # the guard probe's record missing
    ({}, {"g1": {}}, False),  # the handoff's row not found
])
def test_the_probes_wait_for_each_refusals_record_not_only_its_final_row(rows, records, answered):
    """A decode worker fails a refused handoff's row first and writes its probe record after: judging at the row's
    end alone read a missing record as 'not judged' (CI, stop 34)."""
    from incidents.canary.probes import all_answered

    assert all_answered(["g1"], ["h1"], records, rows) is answered


def test_a_valid_handoff_is_judged_by_the_events_read_when_its_row_ended(registry, make_worker, redis_client,
                                                                         ledger_prefix):
    """The check may wait out its deadline for another case's answer; by then the valid case's stream may be gone
    (a stream outlives its final event by the replay window, 60 s). A soak saw that turn a done probe into a
    false critical 'wrong'. The events read when its row ended decide; without them it is read now."""
    from incidents.canary.probes import _judge_handoff
    from incidents.canary.prompts import canary_key
    from inference.params import RequestParams, Sampling
    from inference.streams import OutputStream

    live_worker(registry, make_worker, "decode", worker_id="decode-w1")
    (w,) = registry.live_workers("decode")
    ChatRequest.objects.create(id="canary-probe-valid-x", tenant=canary_key(TENANT_B).tenant, status=S.DONE,
                               model="canary-probe", max_tokens=4, prompt_tokens=3, prompt_hash="canary-probe",
                               decode_worker="decode-w1", decode_verdict="accepted", completion_tokens=4,
                               params=RequestParams(Sampling(temperature=0.0, seed=0)).to_dict())
    cases = [{"case": "valid", "rid": "canary-probe-valid-x"}]
    gone = OutputStream(redis_client, prefix=ledger_prefix)  # its stream expired: nothing under this prefix
    judged = _judge_handoff(w, cases, {}, gone, {"canary-probe-valid-x": ["delta", "done"]})
    assert judged["valid"]["outcome"] == "passed"
    assert _judge_handoff(w, cases, {}, gone)["valid"]["outcome"] == "wrong"  # nothing read before: as it was
