"""The database: DATABASE_URL (PostgreSQL in production), else a SQLite file var/kvserve.sqlite3; connection
reuse, health checks and PostgreSQL's connection pool, all from env."""
import dj_database_url

from kvserve.paths import var_dir
from inference.settings import SettingError, env_bool, env_int

_default = dj_database_url.config(
    default=f"sqlite:///{var_dir() / 'kvserve.sqlite3'}",
    # seconds a connection is reused (0: one per request/task); worker processes profit most (see README)
    conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 0, low=0),
    # a reused connection is pinged before its first query of a request, so a restarted server costs no error
    conn_health_checks=env_bool("DATABASE_CONN_HEALTH_CHECKS", True),
    # behind PgBouncer in transaction mode, which cannot keep a cursor open across transactions
    disable_server_side_cursors=env_bool("DATABASE_DISABLE_SERVER_SIDE_CURSORS", False),
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
elif _default["ENGINE"] == "django.db.backends.postgresql":
    _options = _default.setdefault("OPTIONS", {})
    _options.setdefault("connect_timeout", env_int("DATABASE_CONNECT_TIMEOUT_S", 5, low=1))  # an unreachable server fails fast
    _pool_max = env_int("DATABASE_POOL_MAX_SIZE", 0, low=0)
    if _pool_max:
        # psycopg's pool, per process: connections are shared by its threads (ASGI request threads, Celery's
        # threads pool) instead of one kept per thread. Django refuses it together with persistent connections.
        if _default["CONN_MAX_AGE"]:
            raise SettingError("DATABASE_POOL_MAX_SIZE", _pool_max, "DATABASE_POOL_MAX_SIZE and DATABASE_CONN_MAX_AGE "
                               "are alternatives: with a pool, set DATABASE_CONN_MAX_AGE=0 (the pool keeps the "
                               "connections)")
        _options["pool"] = {"min_size": env_int("DATABASE_POOL_MIN_SIZE", 1, low=0), "max_size": _pool_max,
                            "timeout": env_int("DATABASE_POOL_TIMEOUT_S", 10, low=1)}

DATABASES = {"default": _default}
