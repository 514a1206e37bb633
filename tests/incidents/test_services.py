"""incident_record and friends: a critical incident on a worker really quarantines it in Redis."""
import pytest
from django.core.exceptions import ValidationError

from incidents.models import Incident, WorkerRelease
from incidents.services import incident_acknowledge, incident_record, incident_resolve, worker_release

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


def record(**overrides) -> Incident:
    fields = dict(
        kind="foreign_read", severity="critical", pool="decode", worker="decode-w1",
        pages=[3, 4], reader_request="req-B", previous_owner_request="req-A",
        epochs=[11, 12], detected_by="attention_guard", details={"read_len": 17},
    )
    fields.update(overrides)
    return incident_record(**fields)


def test_critical_incident_quarantines_worker_in_redis(registry, registry_redis):
    incident = record()
    assert incident.pk and incident.quarantined
    assert registry_redis.exists(registry.key("quarantine", "decode-w1"))  # raw key, not just the API
    assert registry.is_quarantined("decode-w1")
    assert registry.quarantine_reason("decode-w1") == f"incident #{incident.pk}: foreign_read"
    stored = Incident.objects.get(pk=incident.pk)
    assert (stored.pages, stored.epochs, stored.details) == ([3, 4], [11, 12], {"read_len": 17})


def test_quarantine_holds_through_heartbeats_and_blocks_serving(registry, make_worker):
    registry.register(make_worker("prefill", worker_id="prefill-w1"))
    registry.register(make_worker("decode", worker_id="decode-w1"))
    assert registry.effective_limit() == 8192
    record()
    assert registry.heartbeat("decode-w1").quarantined
    assert registry.effective_limit() is None


@pytest.mark.parametrize("overrides", [{"severity": "warning"}, {"severity": "info"}, {"worker": ""}])
def test_non_critical_or_workerless_incident_does_not_quarantine(registry, overrides):
    incident = record(**overrides)
    assert not incident.quarantined
    assert not registry.is_quarantined("decode-w1")


@pytest.mark.parametrize("overrides", [{"kind": "made_up"}, {"severity": "fatal"}, {"detected_by": ""}])
def test_invalid_incident_is_refused_and_nothing_is_written(registry, overrides):
    with pytest.raises((ValueError, ValidationError)):
        record(**overrides)
    assert Incident.objects.count() == 0
    assert not registry.is_quarantined("decode-w1")


def test_incident_is_kept_when_redis_is_unreachable(settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/15"  # nothing listens on port 1
    incident = record()
    stored = Incident.objects.get(pk=incident.pk)
    assert not stored.quarantined and "quarantine_error" in stored.details


def test_acknowledge_and_resolve(admin_user):
    incident = record()
    incident_acknowledge(incident=incident, by_user=admin_user)
    first_ack = incident.acknowledged_at
    incident_acknowledge(incident=incident, by_user=admin_user)
    assert incident.acknowledged_at == first_ack and incident.acknowledged_by == admin_user
    incident_resolve(incident=incident, by_user=admin_user, notes="stale page, scrub fixed")
    stored = Incident.objects.get(pk=incident.pk)
    assert stored.resolved_by == admin_user and stored.resolved_at is not None
    assert stored.notes == "stale page, scrub fixed"


def test_resolve_does_not_release_but_worker_release_does_and_is_logged(registry, admin_user):
    incident = record()
    incident_resolve(incident=incident, by_user=admin_user)
    assert registry.is_quarantined("decode-w1")
    release = worker_release("decode-w1", admin_user, notes="checked")
    assert not registry.is_quarantined("decode-w1")
    assert release.was_quarantined and release.released_by == admin_user
    assert release.quarantine_reason == f"incident #{incident.pk}: foreign_read"
    again = worker_release("decode-w1", admin_user)
    assert not again.was_quarantined
    assert WorkerRelease.objects.filter(worker="decode-w1").count() == 2


def test_ids_of_any_length_are_recorded_and_the_whole_id_is_quarantined(registry):
    worker = "decode-" + "h" * 300 + "-4242-abcd"  # a long FQDN: longer than any column
    incident = record(worker=worker, pool=worker, reader_request="r" * 400, detected_by="d" * 300)
    stored = Incident.objects.get(pk=incident.pk)
    assert len(stored.worker) == 255 and stored.worker.endswith("…")
    assert stored.details["full_ids"]["worker"] == worker and stored.details["full_ids"]["reader_request"] == "r" * 400
    assert stored.quarantined and registry.is_quarantined(worker)
