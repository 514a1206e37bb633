"""Admin for tenants and API keys: create a key (shown once; needs add_apikey), revoke keys (change_apikey).
Both are written to the admin log with who did it; hashes and raw keys never are."""
from django.contrib import admin, messages
from django.template.response import TemplateResponse

from kvserve.tenants.models import ApiKey, Tenant
from kvserve.tenants.services import api_key_create, api_key_revoke


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
    actions = ["create_api_key"]

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
