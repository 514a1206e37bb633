"""Per-tenant usage per UTC hour (TenantUsage, TenantFailure): counted in the database where a request ends (in the
transaction that ends its row, with F() increments) and where the API refuses a call with 429; and read back per
tenant over a period, for the dashboard, the Tenant admin page and the billing CSV."""
import csv
import datetime as dt
import io
from contextlib import contextmanager

from django.db.models import F, Sum
from django.utils import timezone

from kvserve.tenants.models import Tenant, TenantFailure, TenantUsage

COUNTS = ("requests", "completed", "prompt_tokens", "completion_tokens", "cached_tokens", "refused_429", "failed")


def hour_of(when: dt.datetime | None = None) -> dt.datetime:
    when = timezone.now() if when is None else when
    return when.astimezone(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)


def _bump(model, keys: dict, increments: dict) -> None:
    row, _ = model.objects.get_or_create(**keys)  # a unique (tenant, hour[, code]): a racing create re-reads
    model.objects.filter(pk=row.pk).update(**{k: F(k) + v for k, v in increments.items()})


def usage_request_done(tenant_id: int, admitted_at: dt.datetime, *, prompt_tokens: int, completion_tokens: int,
                       cached_tokens: int) -> None:
    """A request answered: call in the transaction that marks its row done."""
    _bump(TenantUsage, {"tenant_id": tenant_id, "hour": hour_of(admitted_at)},
          {"requests": 1, "completed": 1, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "cached_tokens": cached_tokens})


def usage_request_failed(tenant_id: int, admitted_at: dt.datetime, code: str) -> None:
    """A request ended failed or rejected with `code`: call in the transaction that ends its row."""
    hour = hour_of(admitted_at)
    _bump(TenantUsage, {"tenant_id": tenant_id, "hour": hour}, {"requests": 1, "failed": 1})
    _bump(TenantFailure, {"tenant_id": tenant_id, "hour": hour, "code": code[:64]}, {"count": 1})


def usage_refused(tenant_id: int, when: dt.datetime | None = None) -> None:
    """The API refused one of the tenant's calls with 429 (no request row was written)."""
    _bump(TenantUsage, {"tenant_id": tenant_id, "hour": hour_of(when)}, {"refused_429": 1})


@contextmanager
def usage_refusal_counted(tenant_id: int):
    """A 429 raised inside counts as the tenant's refusal, once whatever transaction inside has rolled back (put it
    outside that transaction)."""
    try:
        yield
    except Exception as exc:
        if getattr(exc, "status_code", None) == 429:
            usage_refused(tenant_id)
        raise


# ---- reading --------------------------------------------------------------------------------------------

def usage_by_tenant(start: dt.datetime, end: dt.datetime, tenant_ids=None) -> list[dict]:
    """Per tenant with any usage in the hours [start, end): the counts, failures {code: n}, the cache hit rate."""
    rows = TenantUsage.objects.filter(hour__gte=start, hour__lt=end)
    failures = TenantFailure.objects.filter(hour__gte=start, hour__lt=end)
    if tenant_ids is not None:
        rows, failures = rows.filter(tenant_id__in=tenant_ids), failures.filter(tenant_id__in=tenant_ids)
    sums = rows.values("tenant_id", "tenant__name").annotate(**{k: Sum(k) for k in COUNTS}).order_by("tenant_id")
    by_code: dict[int, dict[str, int]] = {}
    for f in failures.values("tenant_id", "code").annotate(n=Sum("count")).order_by("tenant_id", "code"):
        by_code.setdefault(f["tenant_id"], {})[f["code"]] = f["n"]
    out = []
    for s in sums:
        entry = {"tenant_id": s["tenant_id"], "tenant_name": s["tenant__name"], **{k: s[k] or 0 for k in COUNTS},
                 "failures": by_code.get(s["tenant_id"], {})}
        entry["cache_hit_rate"] = (round(entry["cached_tokens"] / entry["prompt_tokens"], 4)
                                   if entry["prompt_tokens"] else None)
        out.append(entry)
    return out


def usage_csv(start: dt.datetime, end: dt.datetime, *, names: bool, tenant_ids=None) -> str:
    """One line per tenant per hour in [start, end), oldest first; the tenant's name only when `names`."""
    rows = TenantUsage.objects.filter(hour__gte=start, hour__lt=end).select_related("tenant").order_by("hour",
                                                                                                        "tenant_id")
    failures = TenantFailure.objects.filter(hour__gte=start, hour__lt=end)
    if tenant_ids is not None:
        rows, failures = rows.filter(tenant_id__in=tenant_ids), failures.filter(tenant_id__in=tenant_ids)
    codes: dict[tuple, list[str]] = {}
    for f in failures.order_by("code"):
        codes.setdefault((f.tenant_id, f.hour), []).append(f"{f.code}={f.count}")
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["hour_utc", "tenant_id", *(["tenant_name"] if names else []), *COUNTS, "failures"])
    for r in rows:
        writer.writerow([r.hour.astimezone(dt.timezone.utc).isoformat(), r.tenant_id,
                         *([r.tenant.name] if names else []), *(getattr(r, k) for k in COUNTS),
                         ";".join(codes.get((r.tenant_id, r.hour), []))])
    return out.getvalue()


def tenant_usage_summary(tenant: Tenant, now: dt.datetime | None = None) -> list[tuple[str, dict | None]]:
    """(label, totals or None) over the last 24 hours, 30 days and all time: for the Tenant admin page."""
    now = timezone.now() if now is None else now
    end = hour_of(now) + dt.timedelta(hours=1)
    periods = (("last 24 hours", end - dt.timedelta(hours=24)), ("last 30 days", end - dt.timedelta(days=30)),
               ("all time", dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)))
    return [(label, (usage_by_tenant(start, end, [tenant.pk]) or [None])[0]) for label, start in periods]
