"""The database: DATABASE_URL (PostgreSQL in production), else a SQLite file var/kvserve.sqlite3."""
import dj_database_url

from kvserve.paths import var_dir
from kvserve.settings.env import env_int

_default = dj_database_url.config(
    default=f"sqlite:///{var_dir() / 'kvserve.sqlite3'}",
    conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 0),
)
if _default["ENGINE"] == "django.db.backends.sqlite3":
    # Web + prefill + decode + beat share the file: WAL and IMMEDIATE avoid "database is locked".
    _default.setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )

DATABASES = {"default": _default}
