"""App config for tenants."""
from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "kvserve.tenants"
    label = "tenants"
    verbose_name = "Tenants and API keys"
