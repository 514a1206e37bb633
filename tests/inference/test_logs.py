"""inference/logs.py: every line names its process (role, pid, worker id), as plain text or one JSON object;
the role from the command line until the worker runtime names it."""
import io
import json
import logging
import logging.config
import os

import pytest

from inference import logs
from inference.logs import JsonFormatter, log_context_set, logging_config, process_role


@pytest.fixture
def emitted(monkeypatch):
    """Configures logging as a kvserve process would (`fmt`), into a buffer; yields (configure, read)."""
    monkeypatch.setattr(logs, "_context", {"role": None, "worker_id": logs.NO_WORKER})
    loggers = [logging.getLogger(name or None) for name in ["", *logging_config()["loggers"]]]
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    stream = io.StringIO()

    def configure(fmt: str) -> None:
        config = logging_config("INFO", fmt)
        config["handlers"]["console"]["stream"] = stream
        logging.config.dictConfig(config)

    yield configure, lambda: stream.getvalue().splitlines()
    for lg, handlers, level, propagate in saved:  # as the test found them
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate


def test_a_plain_line_names_role_pid_and_worker(emitted):
    configure, lines = emitted
    configure("plain")
    log = logging.getLogger("inference.worker")
    log.warning("before the engine")
    log_context_set(role="decode", worker_id="decode-h-1-ab12")
    log.warning("pool %s lost", "p1")
    before, after = lines()
    assert f"WARNING inference.worker [{process_role()} {os.getpid()} -] before the engine" in before
    assert after.endswith(f"WARNING inference.worker [decode {os.getpid()} decode-h-1-ab12] pool p1 lost")


def test_a_json_line_is_one_object_with_the_same_fields_and_the_extras(emitted):
    configure, lines = emitted
    configure("json")
    log_context_set(role="prefill", worker_id="prefill-h-2-cd34")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("celery.worker").error("task %s failed", "t1", exc_info=True,
                                                 extra={"status_code": 503, "request": object()})
    (line,) = lines()
    body = json.loads(line)
    assert {k: body[k] for k in ("level", "logger", "role", "pid", "worker_id", "message", "status_code")} == {
        "level": "ERROR", "logger": "celery.worker", "role": "prefill", "pid": os.getpid(),
        "worker_id": "prefill-h-2-cd34", "message": "task t1 failed", "status_code": 503}
    assert body["time"].endswith("+00:00") and "T" in body["time"]
    assert "RuntimeError: boom" in body["exc_info"] and body["request"].startswith("<object object")


def test_json_keeps_text_that_is_not_ascii_and_lines_that_hold_newlines():
    record = logging.LogRecord("kvserve", logging.INFO, __file__, 1, "prompt «%s»\nnext", ("é",), None)
    record.role, record.worker_id = "web", "-"
    text = JsonFormatter().format(record)
    assert "\n" not in text and json.loads(text)["message"] == "prompt «é»\nnext"


@pytest.mark.parametrize("argv, role", [
    (["/venv/lib/python3.11/site-packages/uvicorn/__main__.py", "kvserve.asgi:application"], "web"),
    (["/venv/bin/gunicorn", "kvserve.wsgi"], "web"),
    (["manage.py", "runserver"], "web"),
    (["/venv/lib/python3.11/site-packages/celery/__main__.py", "-A", "kvserve", "beat"], "beat"),
    (["/venv/bin/celery", "-A", "kvserve", "worker", "-Q", "decode"], "worker"),  # the runtime names it decode
    (["manage.py", "migrate"], "manage"),
    (["scripts/run.py"], "run"),
    ([], "python"),
])
def test_the_role_from_the_command_line(argv, role):
    assert process_role(argv) == role


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="use one of plain, json"):
        logging_config("INFO", "xml")
