import pytest

from tests.e2e.stack import Stack

# The production database set-up the README recommends: workers keep their connections (threads pool,
# long-lived threads) with health checks; the ASGI web process shares a psycopg pool among its request threads.
POSTGRES_WORKER_ENV = {"DATABASE_CONN_MAX_AGE": "60", "DATABASE_CONN_HEALTH_CHECKS": "1"}
POSTGRES_WEB_ENV = {"DATABASE_CONN_MAX_AGE": "0", "DATABASE_POOL_MAX_SIZE": "8"}


@pytest.fixture(scope="session")
def stack(tmp_path_factory, real_model, postgres):
    """One real stack (prefill + decode workers with the default model, web under uvicorn) per test run, on a
    throwaway PostgreSQL database; `own_stack` stacks run on SQLite, so the e2e suite covers both."""
    s = Stack(tmp_path_factory.mktemp("stack"), DATABASE_URL=postgres.create_database("stack"), **POSTGRES_WORKER_ENV)
    try:
        yield s.start(web_env=POSTGRES_WEB_ENV)
    finally:
        s.close()


@pytest.fixture
def own_stack(tmp_path):
    """A stack of this test's own, for tests that kill or misconfigure workers (SQLite)."""
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def postgres_stack(tmp_path, postgres):
    """A stack of this test's own on a throwaway PostgreSQL database."""
    s = Stack(tmp_path, DATABASE_URL=postgres.create_database("own"), **POSTGRES_WORKER_ENV)
    try:
        yield s
    finally:
        s.close()
