"""What every log line of a kvserve process carries: its role, pid and engine worker id (LogContextFilter,
filled from the command line and then by the worker runtime), written as plain text or as one JSON object
per line (JsonFormatter); logging_config() is the dictConfig both Django's LOGGING and Celery's processes use.
No Django here: the engine's own lines carry the same fields."""
import json
import logging
import sys
from datetime import datetime, timezone
from pathlib import Path

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(role)s %(process)d %(worker_id)s] %(message)s"
NO_WORKER = "-"
_context: dict[str, str | None] = {"role": None, "worker_id": NO_WORKER}
# LogRecord's own attributes: anything else on a record came in `extra=` and goes into the JSON object
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "role", "worker_id"}


def process_role(argv: list[str] | None = None) -> str:
    """What this process is, from its command line: web (uvicorn, gunicorn, `manage.py runserver`), beat,
    worker (a Celery worker, until its engine names its role), manage, else the program's name."""
    argv = sys.argv if argv is None else argv
    if not argv:
        return "python"
    program = Path(argv[0])
    name = program.parent.name if program.stem == "__main__" else program.stem
    args = argv[1:]
    if name in ("uvicorn", "gunicorn", "daphne") or (name == "manage" and args[:1] == ["runserver"]):
        return "web"
    if name == "celery":
        return "beat" if "beat" in args else "worker"
    return name or "python"


def log_context_set(*, role: str | None = None, worker_id: str | None = None) -> None:
    """Names this process in every later log line (the worker runtime: its role and worker id)."""
    if role is not None:
        _context["role"] = role
    if worker_id is not None:
        _context["worker_id"] = worker_id


def log_context() -> dict[str, str]:
    return {"role": _context["role"] or process_role(), "worker_id": _context["worker_id"] or NO_WORKER}


class LogContextFilter(logging.Filter):
    """On a handler: gives each record `role` and `worker_id` (pid is the record's own `process`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in log_context().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, role, pid, worker_id, message, the
    record's `extra=` fields (as text where JSON has no form for them), exc_info and stack_info as text."""

    def format(self, record: logging.LogRecord) -> str:
        body = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name,
            "role": getattr(record, "role", None), "pid": record.process,
            "worker_id": getattr(record, "worker_id", None), "message": record.getMessage(),
        }
        body.update({k: v for k, v in vars(record).items() if k not in _STANDARD and k not in body})
        if record.exc_info:
            body["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            body["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(body, default=str, ensure_ascii=False)


LOG_FORMATS = ("plain", "json")


def logging_config(level: str = "INFO", fmt: str = "plain") -> dict:
    """The dictConfig of a kvserve process: one stderr handler (the supervisor or the init system files it),
    every line with role, pid and worker id, plain or JSON; `level` for kvserve's own loggers and the root."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(LOG_FORMATS)}")
    formatter = {"()": JsonFormatter} if fmt == "json" else {"format": PLAIN_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": LogContextFilter}},
        "formatters": {"kvserve": formatter},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "kvserve", "filters": ["context"]}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            "django": {"handlers": ["console"], "level": "INFO", "propagate": False},
            # uvicorn's own lines (its --log-level stays theirs): through this handler, not uvicorn's format
            "uvicorn": {"handlers": ["console"], "propagate": False},
            "uvicorn.error": {"handlers": [], "propagate": True},
            "uvicorn.access": {"handlers": [], "propagate": True},
            "kvserve": {"level": level},
            "inference": {"level": level},
            "incidents": {"level": level},
        },
    }
