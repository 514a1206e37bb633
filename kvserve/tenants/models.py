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
