"""ASGI entry point (uvicorn kvserve.asgi:application), needed for streamed responses."""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")
application = get_asgi_application()
