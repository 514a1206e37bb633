"""Admin for tenants and API keys: create a key (shown once; needs add_apikey), revoke keys (change_apikey).
Both are written to the admin log with who did it; hashes and raw keys never are. A tenant's page shows its usage
(kvserve/tenants/usage.py); the changelist exports the selected tenants' usage as CSV."""
import datetime as dt

from django.contrib import admin, messages
from django.http import HttpResponse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.template.response import TemplateResponse

from kvserve.tenants.models import ApiKey, Tenant
from kvserve.tenants.services import api_key_create, api_key_revoke
from kvserve.tenants.usage import hour_of, tenant_usage_summary, usage_csv


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    fields = ("prefix", "created_at", "revoked_at")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("name", "store_text", "created_at")
    list_filter = ("store_text",)
    search_fields = ("name",)
    inlines = [ApiKeyInline]
    actions = ["create_api_key", "export_usage_csv"]
    readonly_fields = ("usage",)

    @admin.display(description="Usage")
    def usage(self, obj) -> str:
        if obj is None or obj.pk is None:
            return "–"
        head = ("Period", "Requests", "Completed", "Prompt tokens", "Completion tokens", "Cached tokens",
                "Cache hit rate", "429s", "Failed", "Failures by code")
        rows = []
        for label, u in tenant_usage_summary(obj):
            if u is None:
                rows.append((label, *["0"] * 5, "–", "0", "0", "–"))
                continue
            rate = "–" if u["cache_hit_rate"] is None else f"{100 * u['cache_hit_rate']:.1f} %"
            codes = ", ".join(f"{c}: {n}" for c, n in u["failures"].items()) or "–"
            rows.append((label, *(f"{u[k]:,}" for k in ("requests", "completed", "prompt_tokens", "completion_tokens",
                                                         "cached_tokens")), rate, f"{u['refused_429']:,}",
                         f"{u['failed']:,}", codes))
        return format_html('<table class="tenant-usage"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>'
                           '<p class="help">Counted per UTC hour of admission where each request ends; tokens are '
                           'those of completed requests (what the API reported in <code>usage</code>).</p>',
                           format_html_join("", "<th>{}</th>", ((h,) for h in head)),
                           format_html_join("", "<tr>" + "<td>{}</td>" * len(head) + "</tr>", rows))

    @admin.action(description="Export usage as CSV (last 30 days, per hour)")
    def export_usage_csv(self, request, queryset):
        end = hour_of(timezone.now()) + dt.timedelta(hours=1)
        body = usage_csv(end - dt.timedelta(days=30), end, names=True, tenant_ids=list(queryset.values_list("pk", flat=True)))
        response = HttpResponse(body, content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="kvserve-usage-{end:%Y%m%d}.csv"'
        return response

    def has_add_apikey_permission(self, request) -> bool:
        return request.user.has_perm("tenants.add_apikey")

    @admin.action(description="Create a new API key (shown once)", permissions=["add_apikey"])
    def create_api_key(self, request, queryset):
        created = []
        for tenant in queryset:
            api_key, raw = api_key_create(tenant.name)
            self.log_addition(request, api_key, f"Minted API key {api_key.prefix}… for tenant {tenant.name}.")
            created.append((tenant, raw))
        response = TemplateResponse(
            request,
            "admin/tenants/api_key_created.html",
            {**self.admin_site.each_context(request), "title": "New API keys", "created": created},
        )
        response["Cache-Control"] = "no-store"
        return response


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "tenant", "created_at", "revoked_at")
    list_filter = ("revoked_at", "tenant")
    search_fields = ("prefix", "tenant__name")
    fields = ("tenant", "prefix", "created_at", "revoked_at")
    readonly_fields = fields
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False  # keys come from `manage.py create_api_key` or the tenant action

    @admin.action(description="Revoke selected API keys", permissions=["change"])
    def revoke(self, request, queryset):
        revoked = 0
        for api_key in queryset:
            if api_key.is_active:
                api_key_revoke(api_key=api_key)
                self.log_change(request, api_key, "Revoked the API key.")
                revoked += 1
        self.message_user(request, f"Revoked {revoked} key(s).", messages.SUCCESS)
