"""The admin site: Django's, except that every admin action which names no permission of its own needs the
model's change permission. Applied to every ModelAdmin as it is registered (kvserve's and third-party ones,
e.g. django-celery-beat's enable/disable/toggle/run of periodic tasks) and to site-wide actions."""
from django.contrib import admin
from django.contrib.admin.apps import AdminConfig

DEFAULT_ACTION_PERMISSIONS = ("change",)


def action_permissions_default(func):
    """`func`, needing the change permission unless it declares its own (@admin.action(permissions=...))."""
    if not hasattr(func, "allowed_permissions"):
        func.allowed_permissions = DEFAULT_ACTION_PERMISSIONS
    return func


class KvserveAdminSite(admin.AdminSite):
    def register(self, model_or_iterable, admin_class=None, **options):
        super().register(model_or_iterable, admin_class, **options)
        for model_admin in self._registry.values():
            for action in model_admin.actions or ():
                found = model_admin.get_action(action)
                if found is not None:
                    action_permissions_default(found[0])

    def add_action(self, action, name=None):
        super().add_action(action_permissions_default(action), name)


class KvserveAdminConfig(AdminConfig):
    default_site = "kvserve.admin_site.KvserveAdminSite"
