"""Throwaway PostgreSQL databases for the tests: one server (KVSERVE_TEST_POSTGRES_URL, default the local one,
which scripts/ensure_postgres.sh starts), a database per use with a unique name, all of a run's dropped at its
end. PostgreSQL that does not answer is an error, never a skip, unless KVSERVE_TEST_POSTGRES=off says so."""
import os
import uuid
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

ADMIN_URL = os.environ.get("KVSERVE_TEST_POSTGRES_URL", "postgres://127.0.0.1:5432/postgres")


class PostgresServer:
    def __init__(self, admin_url: str = ADMIN_URL):
        self.admin_url = admin_url
        self.run = uuid.uuid4().hex[:8]
        self.created: list[str] = []

    def _admin(self):
        return psycopg.connect(self.admin_url.replace("postgres://", "postgresql://", 1), autocommit=True,
                               connect_timeout=5)

    def check(self) -> str:
        with self._admin() as conn:
            return conn.execute("select version()").fetchone()[0]

    def create_database(self, purpose: str) -> str:
        """A new, empty database; its DATABASE_URL."""
        name = f"kvstest_{self.run}_{len(self.created)}_{purpose}"[:63]
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.created.append(name)
        parts = urlsplit(self.admin_url)
        return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, ""))

    def drop_all(self) -> None:
        with self._admin() as conn:
            for name in self.created:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.created = []


def postgres_server_get() -> PostgresServer:
    if os.environ.get("KVSERVE_TEST_POSTGRES") == "off":
        pytest.skip("KVSERVE_TEST_POSTGRES=off: PostgreSQL tests skipped on purpose")
    server = PostgresServer()
    try:
        server.check()
    except psycopg.Error as exc:
        raise RuntimeError(
            f"PostgreSQL at {ADMIN_URL} does not answer ({exc}). Start it with scripts/ensure_postgres.sh (make "
            "test and .ci/run do), point KVSERVE_TEST_POSTGRES_URL at a server where this user may create "
            "databases, or set KVSERVE_TEST_POSTGRES=off to skip these tests knowingly") from exc
    return server
