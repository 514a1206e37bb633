"""`manage.py bootstrap_demo`: the admin user and a demo API key for `make run`, printed as JSON with the
/metrics token.

The admin password and the demo key live in the ignored var/secrets.json (or the environment:
KVSERVE_ADMIN_PASSWORD, KVSERVE_DEMO_API_KEY); the database keeps only the key's hash.
"""
import json

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from kvserve.secrets import secret_get, secret_set
from kvserve.tenants.services import api_key_authenticate, api_key_create


class Command(BaseCommand):
    help = "Create (once) the admin user and a demo tenant key; print both as one JSON line."

    def handle(self, *args, **options):
        password = secret_get("KVSERVE_ADMIN_PASSWORD")[:20]
        user, _ = get_user_model().objects.get_or_create(username="admin", defaults={"is_staff": True})
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        try:
            key = secret_get("KVSERVE_DEMO_API_KEY", generate=False)
        except KeyError:
            key = None
        if not key or api_key_authenticate(key) is None:
            _, key = api_key_create("demo")
            secret_set("KVSERVE_DEMO_API_KEY", key)
        self.stdout.write(json.dumps({"admin_user": "admin", "admin_password": password, "api_key": key,
                                      "metrics_token": settings.KVSERVE_METRICS_TOKEN}))
