"""The canary suite's plumbing: `manage.py canary [--json]` (exit status, one JSON line, a stored CanaryRun),
incidents for failed checks, the schedules (`setup_schedules`, django-celery-beat), task routing and the
scheduled task's no-overlap lock. The marker test's request plan and scanning are checked here too."""
import io
import json
import threading

import pytest
from django.core.management import call_command
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from incidents import tasks
from incidents.canary import suite
from incidents.canary.marker import plan
from incidents.canary.prompts import TENANT_A, TENANT_B, canary_key, new_sentinel, prompt_tokens
from incidents.canary.result import CheckResult, IncidentSpec
from incidents.models import CanaryRun, Incident
from kvserve.celery import app

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


def ok_check():
    return CheckResult("ok", True, details={"seen": 1})


def leaking_check():
    return CheckResult("leaky", False, details={"reason": "sentinel of A in B's response"},
                       incidents=[IncidentSpec(kind="canary_leak", worker="decode-w9", pool="decode-w9",
                                               reader_request="req-b", previous_owner_request="req-a")])


def raising_check():
    raise RuntimeError("redis went away")


def run_command(monkeypatch, checks, *args):
    monkeypatch.setattr(suite, "CHECKS", checks)
    out = io.StringIO()
    code = 0
    try:
        call_command("canary", *args, stdout=out)
    except SystemExit as exc:
        code = exc.code
    return code, out.getvalue()


def test_command_passes_with_one_json_line_at_the_end(monkeypatch):
    code, out = run_command(monkeypatch, {"first": ok_check, "second": ok_check}, "--json")
    assert code == 0
    body = json.loads(out.strip().splitlines()[-1])
    assert body["passed"] is True
    assert [(c["name"], c["passed"]) for c in body["checks"]] == [("first", True), ("second", True)]
    assert {"name", "passed", "duration_s", "details"} <= set(body["checks"][0])
    run = CanaryRun.objects.get(pk=body["run"])
    assert run.passed and run.finished_at and [c["name"] for c in run.checks] == ["first", "second"]
    assert not Incident.objects.exists()


def test_failed_check_exits_1_records_incident_and_quarantines(monkeypatch, registry):
    code, out = run_command(monkeypatch, {"ok": ok_check, "leaky": leaking_check, "boom": raising_check}, "--json")
    assert code == 1
    body = json.loads(out.strip().splitlines()[-1])
    assert body["passed"] is False
    checks = {c["name"]: c for c in body["checks"]}
    assert checks["ok"]["passed"] and not checks["leaky"]["passed"] and not checks["boom"]["passed"]
    assert "RuntimeError: redis went away" in checks["boom"]["details"]["reason"]
    leak = Incident.objects.get(pk=checks["leaky"]["details"]["incidents"][0])
    assert (leak.kind, leak.severity, leak.worker, leak.detected_by) == ("canary_leak", "critical", "decode-w9",
                                                                         "canary leaky")
    assert leak.details["canary_run"] == body["run"] and leak.quarantined and registry.is_quarantined("decode-w9")
    boom = Incident.objects.get(pk=checks["boom"]["details"]["incidents"][0])
    assert boom.severity == "warning" and not boom.quarantined
    assert body["outcome"] == "wrong" and (checks["leaky"]["outcome"], checks["boom"]["outcome"]) == ("wrong", "not_judged")
    assert "[WRONG] leaky" in out and "[NOT JUDGED] boom" in out and "[ok] ok" in out


def busy_check():
    """What live_probes returns for a worker that did not answer its probes (every thread busy)."""
    return CheckResult("busy", False, details={"workers": {"decode-w7": {"outcome": "not_judged"}}},
                       incidents=[IncidentSpec(kind="canary_leak", severity="warning", worker="decode-w7",
                                               pool="decode-w7", details={"outcome": "not_judged"})])


def test_a_not_judged_check_exits_2_with_a_warning_and_never_quarantines(monkeypatch, registry, registry_redis,
                                                                         registry_prefix):
    from incidents.selectors import canary_latest_get
    from inference.metrics import families_read

    code, out = run_command(monkeypatch, {"ok": ok_check, "busy": busy_check}, "--json")
    assert code == 2 and "[NOT JUDGED] busy" in out
    body = json.loads(out.strip().splitlines()[-1])
    assert body["outcome"] == "not_judged" and body["passed"] is False
    (incident,) = Incident.objects.all()
    assert (incident.severity, incident.worker, incident.quarantined) == ("warning", "decode-w7", False)
    assert not registry.is_quarantined("decode-w7")
    latest = canary_latest_get()  # the dashboard
    assert latest["outcome"] == "not_judged"
    assert {c["name"]: c["outcome"] for c in latest["checks"]} == {"ok": "passed", "busy": "not_judged"}
    raw = families_read(registry_redis, registry_prefix)
    assert {tuple(json.loads(k)): int(v) for k, v in raw["canary_checks"].items()} == {
        ("ok", "", "passed"): 1, ("busy", "", "not_judged"): 1, ("busy", "decode-w7", "not_judged"): 1}
    assert {tuple(json.loads(k)): int(v) for k, v in raw["canary_runs"].items()} == {("not_judged",): 1}


def test_only_and_skip_select_checks(monkeypatch):
    monkeypatch.setattr(suite, "CHECKS", {"a": ok_check, "b": leaking_check, "c": ok_check})
    assert suite.select_checks(["c", "a"], None) == ["a", "c"]
    assert suite.select_checks(None, ["b"]) == ["a", "c"]
    code, out = run_command(monkeypatch, {"a": ok_check, "b": leaking_check, "c": ok_check}, "--skip", "b", "--json")
    assert code == 0 and [c["name"] for c in json.loads(out.splitlines()[-1])["checks"]] == ["a", "c"]
    with pytest.raises(Exception, match="unknown canary checks"):
        call_command("canary", "--only", "nope")


def test_setup_schedules_is_idempotent_and_keeps_admin_edits():
    call_command("setup_schedules", stdout=io.StringIO())
    canary = PeriodicTask.objects.get(task="kvserve.canary")
    reaper = PeriodicTask.objects.get(task="kvserve.reap")
    assert (canary.interval.every, canary.interval.period) == (5, IntervalSchedule.MINUTES)
    assert (reaper.interval.every, reaper.interval.period) == (30, IntervalSchedule.SECONDS)
    history = PeriodicTask.objects.get(task="kvserve.history_sample")
    assert (history.interval.every, history.interval.period) == (15, IntervalSchedule.SECONDS)
    canary.enabled = False  # an admin's edit survives
    canary.save()
    call_command("setup_schedules", stdout=io.StringIO())
    assert PeriodicTask.objects.filter(task__startswith="kvserve.").count() == 3
    assert not PeriodicTask.objects.get(task="kvserve.canary").enabled


def test_beat_uses_the_database_scheduler_and_kvserve_tasks_go_to_maintenance(settings):
    assert settings.CELERY_BEAT_SCHEDULER == "django_celery_beat.schedulers:DatabaseScheduler"
    app.loader.import_default_modules()
    assert {"kvserve.canary", "kvserve.reap", "kvserve.history_sample"} <= set(app.tasks)
    for task in ("kvserve.canary", "kvserve.reap", "kvserve.history_sample"):
        assert app.amqp.router.route({}, task)["queue"].name == "maintenance"


def test_periodic_tasks_are_editable_in_the_admin(admin_client):
    call_command("setup_schedules", stdout=io.StringIO())
    pk = PeriodicTask.objects.get(task="kvserve.canary").pk
    assert admin_client.get(f"/admin/django_celery_beat/periodictask/{pk}/change/").status_code == 200


def test_scheduled_task_runs_the_suite_once_at_a_time(monkeypatch, registry_redis, registry_prefix):
    calls = []
    monkeypatch.setattr(suite, "CHECKS", {"ok": lambda: calls.append(1) or ok_check()})
    assert tasks.canary()["passed"] is True and calls == [1]
    assert not registry_redis.exists(f"{registry_prefix}:canary:lock")  # released
    registry_redis.set(f"{registry_prefix}:canary:lock", "someone-else", ex=60)
    assert tasks.canary() is None and calls == [1]  # skipped while another run holds the lock
    assert registry_redis.get(f"{registry_prefix}:canary:lock") == b"someone-else"


def test_canary_tenants_are_created_once():
    a1, a2, b = canary_key(TENANT_A), canary_key(TENANT_A), canary_key(TENANT_B)
    assert a1.pk == a2.pk and a1.tenant.name == TENANT_A and b.tenant.name == TENANT_B
    assert not a1.tenant.store_text


def test_marker_plan_sits_exactly_on_the_limit():
    limit = 8192
    probes = {p.name: p for p in plan(limit)}
    at = probes[f"{TENANT_B}-at-limit"]
    assert at.expect == "accept" and at.prompt_tokens + at.max_tokens == limit
    for name in (f"{TENANT_B}-over-by-prompt", f"{TENANT_B}-over-by-max-tokens"):
        p = probes[name]
        assert p.expect == "refuse" and prompt_tokens(p.messages) + p.max_tokens == limit + 1
    assert probes[f"{TENANT_B}-over-by-prompt"].max_tokens <= 32  # over by its prompt, not its max_tokens
    sentinels = [p.sentinel for p in probes.values()]
    assert len(set(sentinels)) == len(sentinels) == 7
    assert sum(p.tenant == TENANT_A for p in probes.values()) == 2


def test_sentinels_are_fresh_and_shaped():
    batch = {new_sentinel() for _ in range(200)}
    assert len(batch) == 200
    s = batch.pop()
    groups = s.split("-")
    assert len(groups) == 3 and all(g[0].isupper() and g[1].isdigit() and g[2].isupper() for g in groups)


def test_repeated_failures_reuse_open_incidents_until_released_or_acknowledged(monkeypatch, registry):
    from incidents.services import incident_acknowledge, worker_release

    def vacuous():
        return CheckResult.vacuous("v", "no live workers")
    checks = {"leaky": leaking_check, "v": vacuous}
    first = canary_run_ids(checks)
    assert canary_run_ids(checks) == first  # same open incidents: no new rows while nothing changed
    assert Incident.objects.count() == 2
    worker_release("decode-w9", None)
    incident_acknowledge(incident=Incident.objects.get(severity="warning"), by_user=None)
    third = canary_run_ids(checks)
    assert set(third).isdisjoint(first) and Incident.objects.count() == 4
    assert registry.is_quarantined("decode-w9")  # quarantined again: the leak is still there


def canary_run_ids(checks) -> list[int]:
    run = suite.canary_run(checks=checks)
    return [i for c in run.checks for i in c["details"]["incidents"]]


def test_a_check_that_hangs_fails_named_and_the_run_is_stored_and_goes_on():
    release = threading.Event()

    def hanging_check():
        release.wait(60)  # a detector stuck on something that never answers
        return CheckResult("hangs", True)

    try:
        run = suite.canary_run(checks={"hangs": hanging_check, "ok": ok_check}, check_timeout_s=1)
    finally:
        release.set()
    stored = CanaryRun.objects.get(pk=run.pk)
    assert stored.finished_at is not None and not stored.passed
    checks = {c["name"]: c for c in stored.checks}
    assert checks["hangs"]["details"]["reason"] == "the check did not finish within 1s"
    assert not checks["hangs"]["passed"] and checks["ok"]["passed"]
    (incident,) = Incident.objects.filter(pk__in=checks["hangs"]["details"]["incidents"])
    assert incident.severity == "warning" and "did not finish" in incident.details["reason"]


def test_runs_count_per_check_and_worker_in_metrics(registry, registry_redis, registry_prefix):
    from inference.metrics import families_read

    def per_worker():
        return CheckResult("contract", True, details={"workers": {"decode-w1": {}, "decode-w2": {}}})

    suite.canary_run(checks={"contract": per_worker, "leaky": leaking_check})
    raw = families_read(registry_redis, registry_prefix)
    checks = {tuple(json.loads(k)): int(v) for k, v in raw["canary_checks"].items()}
    assert checks == {("contract", "", "passed"): 1, ("contract", "decode-w1", "passed"): 1,
                      ("contract", "decode-w2", "passed"): 1, ("leaky", "", "wrong"): 1,
                      ("leaky", "decode-w9", "wrong"): 1}
    assert {tuple(json.loads(k)): int(v) for k, v in raw["canary_runs"].items()} == {("wrong",): 1}
    assert {tuple(json.loads(k)): int(v) for k, v in raw["incidents"].items()} == {("canary_leak", "critical"): 1}
