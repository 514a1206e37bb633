"""The kvserve Django project: settings, URLs, the Celery app and the chat API apps."""
from kvserve.celery import app as celery_app

__all__ = ("celery_app",)
