"""Incident (one detected violation), CanaryRun (one scheduled detector check), WorkerRelease (admin lifted a quarantine)."""
from django.conf import settings
from django.db import models


class Incident(models.Model):
    class Kind(models.TextChoices):
        FOREIGN_READ = "foreign_read", "Foreign read (page owned by another request)"
        UNWRITTEN_READ = "unwritten_read", "Unwritten read (beyond the written watermark)"
        STALE_EPOCH = "stale_epoch", "Stale epoch"
        HANDOFF_MISMATCH = "handoff_mismatch", "Handoff verdict/count/checksum mismatch"
        HANDOFF_FORGED = "handoff_forged", "Handoff signature invalid"
        CANARY_LEAK = "canary_leak", "Canary marker leaked into another response"
        CONFIG_UNSAFE = "config_unsafe", "Unsafe configuration (window > pool, faults on)"
        LEASE_EXPIRED = "lease_expired", "Page lease expired"
        INTEGRITY = "integrity", "Ledger integrity check failed"

    class Severity(models.TextChoices):
        INFO = "info", "Info"
        WARNING = "warning", "Warning"
        CRITICAL = "critical", "Critical"

    kind = models.CharField(max_length=32, choices=Kind.choices, db_index=True)
    severity = models.CharField(max_length=16, choices=Severity.choices, db_index=True)
    # ids of any length fit: longer values are clipped by incident_record, the full value kept in details
    pool = models.CharField(max_length=255, blank=True, db_index=True)
    worker = models.CharField(max_length=255, blank=True, db_index=True)
    pages = models.JSONField(default=list, blank=True)
    reader_request = models.CharField(max_length=255, blank=True, db_index=True)
    previous_owner_request = models.CharField(max_length=255, blank=True, db_index=True)
    epochs = models.JSONField(default=list, blank=True)
    detected_by = models.CharField(max_length=255)
    details = models.JSONField(default=dict, blank=True)
    quarantined = models.BooleanField(
        default=False, help_text="The worker was quarantined in the registry when this was recorded."
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    acknowledged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    resolved_at = models.DateTimeField(null=True, blank=True)
    notes = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"#{self.pk} {self.severity} {self.kind} on {self.worker or self.pool or '?'}"


class CanaryRun(models.Model):
    started_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    passed = models.BooleanField(default=False)
    checks = models.JSONField(default=list, blank=True, help_text="[{name, passed, duration_s, details}]")

    class Meta:
        ordering = ["-started_at", "-id"]

    def __str__(self) -> str:
        return f"canary {self.started_at:%Y-%m-%d %H:%M:%S} {'passed' if self.passed else 'FAILED'}"


class WorkerRelease(models.Model):
    """Audit log: an admin lifted a worker's quarantine."""

    worker = models.CharField(max_length=255, db_index=True)
    released_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    released_at = models.DateTimeField(auto_now_add=True)
    was_quarantined = models.BooleanField()
    quarantine_reason = models.TextField(blank=True)
    notes = models.TextField(blank=True)

    class Meta:
        ordering = ["-released_at", "-id"]

    def __str__(self) -> str:
        return f"{self.worker} released by {self.released_by} at {self.released_at:%Y-%m-%d %H:%M:%S}"
