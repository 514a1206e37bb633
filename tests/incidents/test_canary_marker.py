"""The marker test's judgement without a stack: its requests go through the real admission code
(chat_request_create: the over-limit ones are refused, the others get rows; inside the test transaction no
task is queued), and the workers' side - output events and read records - is written the way a decode
worker writes them, with or without a leak."""
import pytest

from incidents.canary import marker
from incidents.canary.marker import check_marker
from incidents.canary.prompts import TENANT_A, TENANT_B
from incidents.canary.suite import canary_run
from incidents.models import Incident
from inference.events import Done, Usage
from inference.streams import OutputStream
from kvserve.chat.models import ChatRequest
from tests.incidents.helpers import live_worker

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture
def workers(registry, make_worker):
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1")
    live_worker(registry, make_worker, "decode", worker_id="decode-1")


def fake_workers(monkeypatch, redis, prefix, *, echo=True, leak_into=None, bad_record=None):
    """Replaces only the waiting: every accepted probe 'ran' on decode-1 and wrote its read record."""
    outputs = OutputStream(redis, prefix)

    def read(probes, deadline):
        a_sentinel = next(p.sentinel for p in probes if p.tenant == TENANT_A)
        for i, p in enumerate(p for p in probes if p.request_id):
            text = f"The secret code is {p.sentinel if echo else 'something else'}."
            if p.name == leak_into:
                text += f" Earlier: {a_sentinel[:7]}"  # two of A's three groups are enough
            p.deltas, p.final = [text[:10], text[10:]], Done(usage=Usage(p.prompt_tokens, 12))
            ChatRequest.objects.filter(id=p.request_id).update(status="done", decode_worker="decode-1",
                                                               prefill_worker="prefill-1")
            record = {"request": p.request_id, "pool": "decode-1", "pages": [10 + i], "epochs": [5 + i],
                      "owners": [p.request_id], "page_epochs": [5 + i], "written": [16], "read_len": 16}
            if p.name == bad_record:
                record["owners"] = ["chatcmpl-someone-else"]
            outputs.record_reads([record])
    monkeypatch.setattr(marker, "_read", read)


def test_clean_traffic_passes_and_edges_are_admitted_or_refused_by_the_real_admission(
        workers, monkeypatch, registry_redis, registry_prefix):
    fake_workers(monkeypatch, registry_redis, registry_prefix)
    result = check_marker()
    assert result.passed, result.details["problems"]
    d = result.details
    assert d["echoed"] == {TENANT_A: 2, TENANT_B: 3} and d["leaks"] == [] and len(d["read_records"]) == 5
    reqs = {r["probe"]: r for r in d["requests"]}
    assert reqs["canary-b-at-limit"]["request"] and reqs["canary-b-at-limit"]["max_tokens"] == 8192 - 48
    assert reqs["canary-b-over-by-prompt"]["refusal"]["code"] == "context_length_exceeded"
    assert reqs["canary-b-over-by-max-tokens"]["refusal"]["status"] == 400
    assert ChatRequest.objects.filter(tenant__name__startswith="canary-").count() == 5  # refused ones: no row


@pytest.mark.django_db(transaction=True)  # canary_run runs the check in a thread of its own
def test_a_sentinel_in_another_tenants_response_is_a_leak_and_quarantines(
        workers, monkeypatch, registry, registry_redis, registry_prefix):
    fake_workers(monkeypatch, registry_redis, registry_prefix, leak_into=f"{TENANT_B}-echo-0")
    run = canary_run(checks={"marker": check_marker})
    assert not run.passed
    d = run.checks[0]["details"]
    assert [(leak["reader_probe"], leak["sentinel_of"]) for leak in d["leaks"]] == [
        (f"{TENANT_B}-echo-0", f"{TENANT_A}-echo-0")]
    leaks = Incident.objects.filter(kind="canary_leak", severity="critical")
    assert {i.worker for i in leaks} == {"decode-1", "prefill-1"} and all(i.quarantined for i in leaks)
    assert registry.is_quarantined("decode-1") and registry.is_quarantined("prefill-1")
    assert leaks[0].reader_request == d["leaks"][0]["reader"]
    assert leaks[0].previous_owner_request == d["leaks"][0]["owner_request"]


def test_a_read_record_with_a_foreign_page_fails_the_audit(workers, monkeypatch, registry_redis, registry_prefix):
    fake_workers(monkeypatch, registry_redis, registry_prefix, bad_record=f"{TENANT_A}-echo-1")
    result = check_marker()
    assert not result.passed and result.details["leaks"] == []
    assert [(i.kind, i.worker) for i in result.incidents] == [("foreign_read", "decode-1")]


def test_no_echo_of_a_sentinel_means_vacuous_not_passed(workers, monkeypatch, registry_redis, registry_prefix):
    fake_workers(monkeypatch, registry_redis, registry_prefix, echo=False)
    result = check_marker()
    assert not result.passed and result.details["vacuous"]
    assert any("vacuous" in p for p in result.details["problems"])
    assert [(i.kind, i.severity, i.worker) for i in result.incidents] == [("canary_leak", "warning", "")]


def test_no_workers_is_vacuous(registry):
    result = check_marker()
    assert not result.passed and result.details["reason"].startswith("vacuous")
