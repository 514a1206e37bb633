"""The kvserve Django project: settings, URLs, the Celery app and the chat API apps."""
import inference  # noqa: F401  first: it sets the OpenMP spin before anything loads torch
from kvserve.celery import app as celery_app

__all__ = ("celery_app",)
