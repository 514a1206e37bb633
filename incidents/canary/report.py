"""A stored canary run as tables for its page (/dashboard/canary/<id>/): per check its outcome and what it saw, per
worker (or pool) each probe's outcome and fields, nested values as nested tables; every string escaped."""
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from incidents.canary.result import LABEL, outcome_of_run, outcome_stored
from incidents.models import CanaryRun, Incident

MAX_DEPTH, MAX_ITEMS = 4, 200
PER_WORKER = ("workers", "pools")  # details keys whose value is {worker or pool id: what was seen there}


def value_html(value, depth: int = 0) -> SafeString:
    """A JSON value as HTML: scalars as text, dicts as key/value tables, lists of dicts as tables with a column per
    key, other lists one item a line; deeper than MAX_DEPTH, compact text."""
    if isinstance(value, dict) and value and depth < MAX_DEPTH:
        rows = list(value.items())[:MAX_ITEMS]
        return format_html('<table class="kv">{}</table>', format_html_join(
            "", "<tr><th>{}</th><td>{}</td></tr>", ((k, value_html(v, depth + 1)) for k, v in rows)))
    if isinstance(value, list) and value and depth < MAX_DEPTH:
        items = value[:MAX_ITEMS]
        more = format_html('<p class="hint">… {} more</p>', len(value) - MAX_ITEMS) if len(value) > MAX_ITEMS else ""
        if all(isinstance(i, dict) for i in items):
            cols = list(dict.fromkeys(k for i in items for k in i))
            head = format_html_join("", "<th>{}</th>", ((c,) for c in cols))
            body = format_html_join("", "<tr>{}</tr>", ((format_html_join(
                "", "<td>{}</td>", ((value_html(i.get(c, ""), depth + 1),) for c in cols)),) for i in items))
            return format_html('<table class="rows"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>{}',
                               head, body, more)
        if all(not isinstance(i, (dict, list)) for i in items):
            return format_html("{}{}", ", ".join(str(i) for i in items), more)
        return format_html("<ol>{}</ol>{}", format_html_join("", "<li>{}</li>", ((value_html(i, depth + 1),)
                                                                                  for i in items)), more)
    if value is None or value == {} or value == []:
        return mark_safe("–")
    if isinstance(value, bool):
        return format_html("{}", "yes" if value else "no")
    return format_html("{}", value if depth < MAX_DEPTH else str(value)[:2000])


def _probe_outcome(result) -> str:
    return outcome_stored({"outcome": result.get("outcome"), "passed": result.get("ok", result.get("passed"))})


def per_worker_rows(details: dict) -> list[dict]:
    """[{part, worker, probes: [{name, outcome, label, fields}], fields}] for the details' per-worker parts."""
    out = []
    for part in PER_WORKER:
        seen = details.get(part)
        if not isinstance(seen, dict):
            continue
        for worker, v in seen.items():
            v = v if isinstance(v, dict) else {"value": v}
            checks = v.get("checks") if isinstance(v.get("checks"), dict) else {}
            probes = [{"name": name, "outcome": _probe_outcome(r if isinstance(r, dict) else {"passed": bool(r)}),
                       "fields": value_html({k: x for k, x in r.items() if k not in ("ok", "outcome", "passed")}
                                            if isinstance(r, dict) else r)} for name, r in checks.items()]
            for p in probes:
                p["label"] = LABEL[p["outcome"]]
            out.append({"part": part, "worker": worker, "probes": probes,
                        "fields": value_html({k: x for k, x in v.items() if k != "checks"})})
    return out


def canary_run_report(run: CanaryRun) -> dict:
    stored = [c for c in (run.checks or []) if isinstance(c, dict)]
    incidents = {i.pk: i for i in Incident.objects.filter(details__canary_run=run.pk)}
    checks = []
    for c in stored:
        details = c.get("details") if isinstance(c.get("details"), dict) else {"value": c.get("details")}
        raised = [incidents[i] for i in details.get("incidents", []) if isinstance(i, int) and i in incidents]
        raised += [i for i in incidents.values() if i.details.get("check") == c.get("name") and i not in raised]
        outcome = outcome_stored(c)
        checks.append({"name": str(c.get("name", "?")), "outcome": outcome, "label": LABEL[outcome],
                       "duration_s": c.get("duration_s"), "per_worker": per_worker_rows(details),
                       "details": value_html({k: v for k, v in details.items()
                                              if k not in (*PER_WORKER, "incidents")}),
                       "incidents": [{"id": i.pk, "severity": i.severity, "kind": i.kind, "worker": i.worker,
                                      "url": reverse("admin:incidents_incident_change", args=[i.pk])}
                                     for i in raised]})
    outcome = outcome_of_run(stored)
    return {"run": run, "outcome": outcome, "label": LABEL[outcome], "checks": checks}
