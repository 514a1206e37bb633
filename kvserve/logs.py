"""Logging of the Django and Celery processes: Celery's workers and beat keep Django's LOGGING (role, pid and
worker id on every line, plain or JSON: inference/logs.py) instead of installing a format of their own, and a
503 the service answers while it starts or has no live workers is logged as a warning, not as an error."""
import logging.config

from django.conf import settings
from django.utils.log import log_response


def celery_logging_keep(**_) -> None:
    """Celery's setup_logging signal. A receiver stops Celery from replacing the root logger's handlers
    (and redirecting print() into them): the process logs as settings.LOGGING says, at KVSERVE_LOG_LEVEL
    (the workers' --loglevel does not change it)."""
    logging.config.dictConfig(settings.LOGGING)


def unavailable_log(request, response) -> None:
    """The expected 503 (starting, no live prefill and decode workers) at WARNING; Django's request logger
    would log it as an ERROR, once per health probe while a stack starts."""
    log_response("%s: %s", response.reason_phrase, request.path, response=response, request=request,
                 level="warning")
