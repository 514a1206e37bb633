"""Tenant and ApiKey. Keys are stored as a SHA-256 hash only; `prefix` is kept for display."""
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    store_text = models.BooleanField(
        default=False, help_text="Keep prompt and completion text on ChatRequest rows."
    )
    max_in_flight = models.PositiveIntegerField(
        null=True, blank=True, help_text="Unfinished requests this tenant may have; empty: "
        "KVSERVE_TENANT_MAX_IN_FLIGHT; 0: no limit.")
    kv_share = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text="Share of the smallest live pool's tokens this tenant's KV may hold or be owed; empty: "
        "KVSERVE_TENANT_KV_SHARE; 0: no limit.")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    prefix = models.CharField(max_length=16, help_text="First characters of the key, for display.")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API key"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class TenantUsage(models.Model):
    """A tenant's usage in one UTC hour (the hour its requests were admitted in), counted by kvserve/tenants/usage.py
    where each request ends: what the API reported in `usage` for the completed ones, and how many ended otherwise."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage")
    hour = models.DateTimeField(db_index=True, help_text="Start of the UTC hour.")
    requests = models.PositiveBigIntegerField(default=0, help_text="Requests that ended, whatever the outcome.")
    completed = models.PositiveBigIntegerField(default=0, help_text="Requests answered (status done).")
    prompt_tokens = models.PositiveBigIntegerField(default=0, help_text="Of the completed requests.")
    completion_tokens = models.PositiveBigIntegerField(default=0, help_text="Of the completed requests.")
    cached_tokens = models.PositiveBigIntegerField(default=0, help_text="Of the completed requests' prompts, read "
                                                   "from the prefix cache.")
    refused_429 = models.PositiveBigIntegerField(default=0, help_text="Calls refused with 429 (fair share or "
                                                 "throttle); they wrote no request.")
    failed = models.PositiveBigIntegerField(default=0, help_text="Requests that ended failed or rejected.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "hour"], name="tenant_usage_hour")]
        ordering = ["-hour", "tenant_id"]

    def __str__(self) -> str:
        return f"{self.tenant} {self.hour:%Y-%m-%d %H}:00"


class TenantFailure(models.Model):
    """Requests of a tenant that ended failed or rejected in one UTC hour, by error code."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="failures")
    hour = models.DateTimeField(db_index=True)
    code = models.CharField(max_length=64)
    count = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "hour", "code"], name="tenant_failure_hour_code")]
        ordering = ["-hour", "tenant_id", "code"]
