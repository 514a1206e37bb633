#!/usr/bin/env bash
# Makes sure `promtool` (Debian's prometheus package) is on PATH: tests/incidents/test_alert_rules.py checks
# ops/prometheus/kvserve-rules.yml with `promtool test rules`. The package's server is not started.
set -euo pipefail
command -v promtool >/dev/null && exit 0
echo "installing prometheus (Debian package) for promtool"
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null || { echo "promtool still missing after installing prometheus" >&2; exit 1; }
