#!/usr/bin/env bash
# Makes sure the PostgreSQL server the tests use answers (KVSERVE_TEST_POSTGRES_URL, default
# postgres://127.0.0.1:5432/postgres as the current user): starts the local cluster when it is installed but
# down, installs Debian's postgresql when it is missing (then lets local connections in with trust auth, as
# on the CI machines). The tests create a throwaway database on it per run and drop it at the end
# (tests/postgres.py). Exits non-zero, saying why, when no server can be had.
set -euo pipefail
url="${KVSERVE_TEST_POSTGRES_URL:-postgres://127.0.0.1:5432/postgres}"
if [ "${KVSERVE_TEST_POSTGRES:-}" = "off" ]; then
  echo "KVSERVE_TEST_POSTGRES=off: the PostgreSQL tests will be skipped" >&2
  exit 0
fi
if ! command -v psql >/dev/null; then
  echo "installing postgresql-client (Debian package)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-client >/dev/null
fi
answers() { psql "$url" -Atqc 'select 1' >/dev/null 2>&1; }
answers && exit 0
hostport="${url#postgres*://}"; hostport="${hostport##*@}"; hostport="${hostport%%/*}"; host="${hostport%%:*}"
case "$host" in 127.*|localhost|"") ;; *) echo "PostgreSQL at $url does not answer and is not local: start it there" >&2; exit 1;; esac
installed_here=0
if [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then  # no server installed
  echo "installing postgresql (Debian package)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  installed_here=1
fi
version="$(ls /etc/postgresql | sort -V | tail -n 1)"
if [ "$installed_here" = 1 ]; then  # a cluster of our own making: local connections trusted, as on CI machines
  hba="/etc/postgresql/$version/main/pg_hba.conf"
  printf 'local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n' > "$hba"
fi
echo "starting PostgreSQL $version (cluster main)"
pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
for _ in $(seq 100); do answers && break; sleep 0.2; done
if ! answers && [ "$(id -u)" = 0 ]; then  # up, but no role for this user yet (a fresh Debian cluster)
  runuser -u postgres -- psql -qc "CREATE ROLE \"$(id -un)\" SUPERUSER LOGIN" >/dev/null 2>&1 || true
fi
if ! answers; then
  echo "PostgreSQL at $url does not answer: the e2e and database tests need it (KVSERVE_TEST_POSTGRES_URL" \
       "points at another server; KVSERVE_TEST_POSTGRES=off skips those tests, visibly)" >&2
  exit 1
fi
