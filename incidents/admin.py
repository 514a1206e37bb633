"""Admin for incidents (acknowledge / resolve / release worker), canary runs and worker releases."""
from django.contrib import admin, messages

from incidents.models import CanaryRun, Incident, WorkerRelease
from incidents.services import incident_acknowledge, incident_resolve, worker_release

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
    readonly_fields = [f.name for f in Incident._meta.fields if f.name != "notes"]
    actions = ["acknowledge", "resolve", "release_workers"]

    def has_add_permission(self, request):
        return False  # incidents are recorded by detectors through incident_record only

    @admin.action(description="Acknowledge selected incidents")
    def acknowledge(self, request, queryset):
        for incident in queryset:
            incident_acknowledge(incident=incident, by_user=request.user)
        self.message_user(request, f"Acknowledged {queryset.count()} incident(s).", messages.SUCCESS)

    @admin.action(description="Resolve selected incidents")
    def resolve(self, request, queryset):
        for incident in queryset:
            incident_resolve(incident=incident, by_user=request.user)
        self.message_user(request, f"Resolved {queryset.count()} incident(s).", messages.SUCCESS)

    @admin.action(description="Release the quarantined workers of selected incidents")
    def release_workers(self, request, queryset):
        workers = sorted({w for w in queryset.values_list("worker", flat=True) if w})
        for worker_id in workers:
            worker_release(worker_id, request.user, notes="released from the incident admin")
        self.message_user(request, f"Released: {', '.join(workers) or 'none'}.", messages.WARNING)


@admin.register(CanaryRun)
class CanaryRunAdmin(admin.ModelAdmin):
    list_display = ("id", "started_at", "finished_at", "passed")
    list_filter = ("passed", "started_at")
    search_fields = ("checks",)
    readonly_fields = ("started_at", "finished_at", "passed", "checks")

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
