"""Fixtures of the API tests."""
import logging

import pytest


@pytest.fixture
def request_log():
    """The records of Django's request logger (it does not propagate to the root logger, where caplog listens)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("django.request")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
