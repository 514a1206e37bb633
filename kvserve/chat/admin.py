"""Read-only admin for ChatRequest rows: filter by status/tenant/verdicts, search by id. Text only for superusers."""
from django.contrib import admin

from kvserve.chat.models import ChatRequest

TEXT_FIELDS = ("prompt_text", "completion_text")


@admin.register(ChatRequest)
class ChatRequestAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "status", "prompt_tokens", "completion_tokens", "max_tokens",
                    "handoff_verdict", "decode_verdict", "error_code", "created_at", "finished_at")
    list_filter = ("status", "tenant", "handoff_verdict", "decode_verdict", "stream", "error_code", "created_at")
    search_fields = ("id", "prefill_worker", "decode_worker", "error_code")
    date_hierarchy = "created_at"
    list_select_related = ("tenant",)
    show_full_result_count = False

    def get_fields(self, request, obj=None):
        fields = [f.name for f in ChatRequest._meta.fields]
        return fields if request.user.is_superuser else [f for f in fields if f not in TEXT_FIELDS]

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    def has_add_permission(self, request):
        return False  # rows are written by the chat API and the workers only

    def has_change_permission(self, request, obj=None):
        return False
