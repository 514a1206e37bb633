"""The database under concurrent processes, on SQLite (the embedded default) and on PostgreSQL (production):
claims by conditional UPDATE are won exactly once per row, and select_for_update serializes read-modify-write
(row locks on PostgreSQL, SQLite's IMMEDIATE transactions lock the whole file). Without the lock PostgreSQL
loses updates: what select_for_update is for there."""
import json
import subprocess
import sys

import pytest

from tests.e2e.stack import ROOT

PROCESSES = 4


def _env(tmp_path, url: str) -> dict:
    import os

    return {**os.environ, "DATABASE_URL": url, "KVSERVE_SECRETS_FILE": str(tmp_path / "secrets.json")}


def race(env, *argv_per_process) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-m", "tests.e2e.db_race", *argv], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in argv_per_process]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'race.sqlite3'}"
    else:
        url = request.getfixturevalue("postgres").create_database("race")
    env = _env(tmp_path, url)
    migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    return request.param, env


@pytest.mark.timeout(600)
def test_claims_and_row_locks_under_concurrent_processes(database):
    backend, env = database
    rows = 60
    assert race(env, ["setup", str(rows)]) == [{"rows": rows}]
    won = [r["won"] for r in race(env, *[["claim", str(rows), str(seed)] for seed in range(PROCESSES)])]
    claimed = [rid for w in won for rid in w]
    assert sorted(claimed) == sorted(f"race-{i}" for i in range(rows))  # every row once, none twice

    per = 8
    race(env, *[["increment", str(per), "1"] for _ in range(PROCESSES)])
    assert race(env, ["read"]) == [{"value": PROCESSES * per}]  # select_for_update: no update lost

    race(env, *[["increment", str(per), "0"] for _ in range(PROCESSES)])
    (after,) = race(env, ["read"])
    if backend == "sqlite":  # BEGIN IMMEDIATE: a transaction holds the file's write lock from its first read
        assert after["value"] == 2 * PROCESSES * per
    else:  # READ COMMITTED without a row lock: concurrent read-then-write loses increments
        assert after["value"] < 2 * PROCESSES * per
