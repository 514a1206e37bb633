#!/usr/bin/env bash
# Starts a local Redis when none answers on REDIS_URL (default 127.0.0.1:6379) and checks that it
# never evicts keys: page-ownership records must not vanish.
set -euo pipefail
url="${REDIS_URL:-redis://127.0.0.1:6379/0}"
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  echo "installing redis-server (Debian package)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if ! redis-cli -u "$url" ping >/dev/null 2>&1; then
  hostport="${url#redis://}"; hostport="${hostport##*@}"; hostport="${hostport%%/*}"
  host="${hostport%%:*}"; port="${hostport##*:}"; [ "$port" = "$hostport" ] && port=6379
  case "$host" in 127.*|localhost|"") ;; *) echo "Redis at $url does not answer and is not local: start it there" >&2; exit 1;; esac
  mkdir -p var
  echo "starting redis-server on $host:$port"
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
    --dir "$PWD/var" --logfile "$PWD/var/redis-$port.log" --maxmemory-policy noeviction
  for _ in $(seq 50); do redis-cli -u "$url" ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
policy="$(redis-cli -u "$url" config get maxmemory-policy | tail -n 1)"
if [ "$policy" != "noeviction" ]; then
  echo "Redis at $url has maxmemory-policy=$policy; kvserve needs noeviction:" >&2
  echo "  redis-cli -u $url CONFIG SET maxmemory-policy noeviction   (and set it in redis.conf)" >&2
  exit 1
fi
