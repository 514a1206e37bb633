"""ASGI entry point (uvicorn kvserve.asgi:application), needed for streamed responses; client disconnects
are made visible to requests waiting in threads (kvserve/chat/disconnect.py)."""
import os

from django.core.asgi import get_asgi_application

from kvserve.chat.disconnect import watch_disconnect

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")
application = watch_disconnect(get_asgi_application())
