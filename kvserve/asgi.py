"""ASGI entry point (uvicorn kvserve.asgi:application), needed for streamed responses. Request bodies are
capped around Django, before anything (authentication included) reads them: kvserve/bodylimit.py."""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402  (configured by get_asgi_application)

from kvserve.bodylimit import BodyLimitMiddleware  # noqa: E402

application = BodyLimitMiddleware(django_application, max_bytes=settings.KVSERVE_MAX_BODY_BYTES)
