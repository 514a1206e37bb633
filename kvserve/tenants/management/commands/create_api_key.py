"""`manage.py create_api_key TENANT`: creates a key; the raw key is the last line printed."""
from django.core.management.base import BaseCommand

from kvserve.tenants.services import api_key_create


class Command(BaseCommand):
    help = "Create an API key for TENANT (created if new). The key is printed once, as the last line."

    def add_arguments(self, parser):
        parser.add_argument("tenant")

    def handle(self, *args, tenant, **options):
        api_key, raw = api_key_create(tenant)
        self.stderr.write(
            f"Created API key {api_key.prefix}… for tenant {api_key.tenant.name!r}. "
            "It is stored hashed and shown only now:"
        )
        self.stdout.write(raw)
