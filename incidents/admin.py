"""Admin for incidents (acknowledge / resolve: change_incident; release worker: add_workerrelease), canary
runs and worker releases. Every action is written to the admin log with who did it."""
from django.contrib import admin, messages
from django.contrib.admin.models import ADDITION, LogEntry
from django.urls import reverse
from django.utils.html import format_html

from incidents.models import CanaryRun, Incident, WorkerRelease
from incidents.services import incident_acknowledge, incident_resolve, worker_release

# Releasing a worker, from the Workers page or the incident action, needs this one permission.
RELEASE_PERMISSION = "incidents.add_workerrelease"


def admin_worker_release(request, worker_id: str, *, notes: str) -> WorkerRelease:
    """worker_release by the admin user of `request`, written to the admin log."""
    release = worker_release(worker_id, request.user, notes=notes)
    state = f"was quarantined: {release.quarantine_reason}" if release.was_quarantined else "was not quarantined"
    LogEntry.objects.log_actions(user_id=request.user.pk, queryset=[release], action_flag=ADDITION,
                                 change_message=f"Released worker {worker_id} ({state}).", single_object=True)
    return release

# The admin index links the operator pages (dashboard, Workers, metrics): templates/admin/kvserve_index.html.
admin.site.index_template = "admin/kvserve_index.html"
admin.site.site_header = admin.site.site_title = "kvserve administration"


@admin.register(Incident)
class IncidentAdmin(admin.ModelAdmin):
    list_display = ("id", "created_at", "severity", "kind", "pool", "worker", "quarantined",
                    "reader_request", "previous_owner_request", "acknowledged_at", "resolved_at")
    list_filter = ("severity", "kind", "pool", "quarantined", "detected_by",
                   ("acknowledged_at", admin.EmptyFieldListFilter),
                   ("resolved_at", admin.EmptyFieldListFilter), "created_at")
    search_fields = ("worker", "pool", "reader_request", "previous_owner_request", "detected_by", "notes")
    date_hierarchy = "created_at"
    readonly_fields = [f.name for f in Incident._meta.fields if f.name != "notes"] + ["canary_run"]
    actions = ["acknowledge", "resolve", "release_workers"]

    @admin.display(description="Canary run")
    def canary_run(self, obj) -> str:
        """The run that raised it, when a canary check did (its details name the run)."""
        run = obj.details.get("canary_run") if isinstance(obj.details, dict) else None
        if not isinstance(run, int):
            return "–"
        return format_html('<a href="{}">canary run #{}: what each check probed and saw</a>',
                           reverse("canary-run", args=[run]), run)

    def has_add_permission(self, request):
        return False  # incidents are recorded by detectors through incident_record only

    def has_release_worker_permission(self, request) -> bool:
        return request.user.has_perm(RELEASE_PERMISSION)

    @admin.action(description="Acknowledge selected incidents", permissions=["change"])
    def acknowledge(self, request, queryset):
        for incident in queryset:
            if incident.acknowledged_at is None:
                incident_acknowledge(incident=incident, by_user=request.user)
                self.log_change(request, incident, "Acknowledged.")
        self.message_user(request, f"Acknowledged {queryset.count()} incident(s).", messages.SUCCESS)

    @admin.action(description="Resolve selected incidents", permissions=["change"])
    def resolve(self, request, queryset):
        for incident in queryset:
            if incident.resolved_at is None:
                incident_resolve(incident=incident, by_user=request.user)
                self.log_change(request, incident, "Resolved.")
        self.message_user(request, f"Resolved {queryset.count()} incident(s).", messages.SUCCESS)

    @admin.action(description="Release the quarantined workers of selected incidents", permissions=["release_worker"])
    def release_workers(self, request, queryset):
        workers = sorted({w for w in queryset.values_list("worker", flat=True) if w})
        for worker_id in workers:
            admin_worker_release(request, worker_id, notes="released from the incident admin")
        self.message_user(request, f"Released: {', '.join(workers) or 'none'}.", messages.WARNING)


@admin.register(CanaryRun)
class CanaryRunAdmin(admin.ModelAdmin):
    list_display = ("id", "started_at", "finished_at", "passed")
    list_filter = ("passed", "started_at")
    search_fields = ("checks",)
    readonly_fields = ("started_at", "finished_at", "passed", "page", "checks")

    @admin.display(description="Readable")
    def page(self, obj) -> str:
        return format_html('<a href="{}">per check and per worker, as tables</a>', reverse("canary-run", args=[obj.pk]))

    def has_add_permission(self, request):
        return False


@admin.register(WorkerRelease)
class WorkerReleaseAdmin(admin.ModelAdmin):
    list_display = ("worker", "released_by", "released_at", "was_quarantined", "quarantine_reason")
    list_filter = ("was_quarantined", "released_at")
    search_fields = ("worker", "quarantine_reason", "notes")
    readonly_fields = ("worker", "released_by", "released_at", "was_quarantined", "quarantine_reason", "notes")

    def has_add_permission(self, request):
        return False
