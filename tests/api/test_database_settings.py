"""kvserve/settings/database.py: what DATABASE_* turn into (settings are read once per process: subprocesses)."""
import json
import os
import subprocess
import sys

from tests.e2e.stack import ROOT

PRINT = ("import json, django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'kvserve.settings'; django.setup(); "
         "from django.conf import settings; d = settings.DATABASES['default']; "
         "print(json.dumps({k: d.get(k) for k in ('ENGINE', 'CONN_MAX_AGE', 'CONN_HEALTH_CHECKS', 'OPTIONS', "
         "'DISABLE_SERVER_SIDE_CURSORS')}, default=str))")


def settings_with(tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRINT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVSERVE_SECRETS_FILE": str(tmp_path / "s.json"), **env})


def test_postgres_workers_keep_checked_connections(tmp_path):
    out = settings_with(tmp_path, DATABASE_URL="postgres://u@db:5432/kv", DATABASE_CONN_MAX_AGE="60")
    d = json.loads(out.stdout)
    assert d["ENGINE"] == "django.db.backends.postgresql" and d["CONN_MAX_AGE"] == 60 and d["CONN_HEALTH_CHECKS"]
    assert d["OPTIONS"] == {"connect_timeout": 5} and not d["DISABLE_SERVER_SIDE_CURSORS"]


def test_postgres_pool_and_pgbouncer_switches(tmp_path):
    out = settings_with(tmp_path, DATABASE_URL="postgres://u@db:5432/kv", DATABASE_POOL_MAX_SIZE="8",
                        DATABASE_DISABLE_SERVER_SIDE_CURSORS="1", DATABASE_CONNECT_TIMEOUT_S="2")
    d = json.loads(out.stdout)
    assert d["OPTIONS"] == {"connect_timeout": 2, "pool": {"min_size": 1, "max_size": 8, "timeout": 10}}
    assert d["CONN_MAX_AGE"] == 0 and d["DISABLE_SERVER_SIDE_CURSORS"]


def test_a_pool_with_persistent_connections_is_refused_naming_the_fix(tmp_path):
    out = settings_with(tmp_path, DATABASE_URL="postgres://u@db:5432/kv", DATABASE_POOL_MAX_SIZE="8",
                        DATABASE_CONN_MAX_AGE="60")
    assert out.returncode != 0 and "set DATABASE_CONN_MAX_AGE=0" in out.stderr


def test_sqlite_keeps_wal_and_immediate_transactions(tmp_path):
    d = json.loads(settings_with(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path}/x.sqlite3").stdout)
    assert d["OPTIONS"]["transaction_mode"] == "IMMEDIATE" and "journal_mode=WAL" in d["OPTIONS"]["init_command"]
