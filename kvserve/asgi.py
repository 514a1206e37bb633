"""ASGI entry point (uvicorn kvserve.asgi:application), needed for streamed responses. Request bodies are
capped around Django, before anything (authentication included) reads them (kvserve/bodylimit.py); client
disconnects are made visible to requests waiting in threads (kvserve/chat/disconnect.py)."""
import os

from django.core.asgi import get_asgi_application

from kvserve.chat.disconnect import watch_disconnect

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402  (configured by get_asgi_application)

from kvserve.bodylimit import BodyLimitMiddleware  # noqa: E402

# outermost: the body cap (it reads the body first); inside it, the disconnect watch sees the replayed body
# and then the client's own later messages (http.disconnect)
application = BodyLimitMiddleware(watch_disconnect(django_application), max_bytes=settings.KVSERVE_MAX_BODY_BYTES)
