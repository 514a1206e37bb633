"""ChatRequest: one API call's lifecycle, usage, timings and handoff verdict. Prompt and completion
text are kept only when the tenant opted in (Tenant.store_text); otherwise a hash and counts."""
from django.db import models

from inference.params import RequestParams
from kvserve.tenants.models import ApiKey, Tenant


class ChatRequest(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        PREFILLING = "prefilling"
        DECODING = "decoding"
        DONE = "done"
        FAILED = "failed"
        REJECTED = "rejected"

    FINAL = (Status.DONE, Status.FAILED, Status.REJECTED)

    id = models.CharField(primary_key=True, max_length=64)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="requests")
    api_key = models.ForeignKey(ApiKey, on_delete=models.SET_NULL, null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    model = models.CharField(max_length=100)
    stream = models.BooleanField(default=False)
    params = models.JSONField(default=dict)  # RequestParams.to_dict(); read as `request_params`
    prompt_hash = models.CharField(max_length=64)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    max_tokens = models.PositiveIntegerField(default=0)
    prompt_text = models.TextField(null=True, blank=True)
    completion_text = models.TextField(null=True, blank=True)
    finish_reason = models.CharField(max_length=16, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)
    handoff_verdict = models.CharField(max_length=16, blank=True)
    decode_verdict = models.CharField(max_length=32, blank=True)
    prefill_worker = models.CharField(max_length=200, blank=True)
    decode_worker = models.CharField(max_length=200, blank=True)
    prefill_deliveries = models.PositiveSmallIntegerField(default=0)
    decode_deliveries = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    prefill_started_at = models.DateTimeField(null=True, blank=True)
    prefill_finished_at = models.DateTimeField(null=True, blank=True)
    decode_started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    transfer_ms = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    @property
    def is_final(self) -> bool:
        return self.status in self.FINAL

    @property
    def request_params(self) -> RequestParams:
        return RequestParams.from_dict(self.params)

    def timings(self) -> dict:
        def ms(a, b):
            return round((b - a).total_seconds() * 1000, 1) if a and b else None

        return {"queued_ms": ms(self.created_at, self.prefill_started_at),
                "prefill_ms": ms(self.prefill_started_at, self.prefill_finished_at),
                "transfer_ms": self.transfer_ms,
                "decode_ms": ms(self.decode_started_at, self.finished_at),
                "total_ms": ms(self.created_at, self.finished_at)}
