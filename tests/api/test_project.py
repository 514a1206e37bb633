"""Project plumbing: generated secrets, Celery queue routing and delivery settings, the deploy checks."""
import json
import os
import re
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvserve import celery_app
from kvserve.secrets import secret_get

ROOT = Path(__file__).resolve().parents[2]


def test_secret_from_env_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_HANDOFF_KEY", "from-env")
    assert secret_get("KVSERVE_HANDOFF_KEY", path=tmp_path / "s.json") == "from-env"
    assert not (tmp_path / "s.json").exists()


def test_secret_generated_once_persisted_private(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSERVE_HANDOFF_KEY", raising=False)
    monkeypatch.delenv("DJANGO_SECRET_KEY", raising=False)
    path = tmp_path / "var" / "secrets.json"
    with ThreadPoolExecutor(8) as pool:
        values = set(pool.map(lambda _: secret_get("KVSERVE_HANDOFF_KEY", path=path), range(16)))
    (value,) = values
    assert len(bytes.fromhex(value)) == 32
    other = secret_get("DJANGO_SECRET_KEY", path=path)
    assert other != value
    assert json.loads(path.read_text()) == {"KVSERVE_HANDOFF_KEY": value, "DJANGO_SECRET_KEY": other}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_celery_routes_and_delivery_settings():
    conf = celery_app.conf
    route = celery_app.amqp.router.route
    assert route({}, "inference.prefill_request")["queue"].name == "prefill"
    assert route({}, "inference.decode_request")["queue"].name == "decode"
    assert route({}, "kvserve.reap")["queue"].name == "maintenance"
    assert {q.name for q in conf.task_queues} == {"prefill", "decode", "maintenance"}
    assert conf.worker_pool == "threads"
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.accept_content == ["json"]
    assert conf.beat_scheduler == "django_celery_beat.schedulers:DatabaseScheduler"


# ---- manage.py check --deploy: nothing printed that README does not document ---------------------------

PRODUCTION_ENV = {  # README "Production settings"
    "DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "pG4r9Lw2Zq7Xe1Tb8Nc5Vy3Mh6Kd0Js-Fa_Ru" * 2,
    "DJANGO_ALLOWED_HOSTS": "kvserve.example.com",
    "DJANGO_HTTPS": "1", "DJANGO_HSTS_SECONDS": "31536000", "DJANGO_HSTS_INCLUDE_SUBDOMAINS": "1",
    "DJANGO_HSTS_PRELOAD": "1", "DJANGO_BEHIND_PROXY": "1", "KVSERVE_METRICS_TOKEN": "scrape-token",
}


def check_deploy(tmp_path, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "KVSERVE_METRICS"))}
    return subprocess.run([sys.executable, "manage.py", "check", "--deploy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**base, "KVSERVE_SECRETS_FILE": str(tmp_path / "s.json"),
                                                       **env})


def test_check_deploy_is_silent_with_production_settings(tmp_path):
    out = check_deploy(tmp_path, **PRODUCTION_ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "System check identified no issues (0 silenced)." and out.stderr == "", out


def test_check_deploy_with_the_embedded_defaults_prints_only_what_readme_documents(tmp_path):
    out = check_deploy(tmp_path)
    printed = set(re.findall(r"\((\w+\.[A-Z]\d+)\)", out.stdout + out.stderr))
    assert printed == {"security.W004", "security.W008", "security.W012", "security.W016"}, out.stdout
    readme = (ROOT / "README.md").read_text()
    assert all(check in readme for check in printed)


# ---- every setting is checked at start: a malformed one stops the process, naming the variable ------------

@pytest.mark.parametrize("name, raw", [
    ("KVSERVE_PREFIX_SHARE_GROUPS", "everyone"),  # was a 503 on every prefill, at run time
    ("KVSERVE_PREFIX_SHARE_GROUPS", "a=t1;b=t1"),
    ("KVSERVE_NUM_PAGES", "1k"),  # a worker's setting: every process refuses it
    ("KVSERVE_CLAMP_WINDOW", "maybe"),  # was read as off
    ("DJANGO_DEBUG", "sure"),
    ("KVSERVE_TENANT_MAX_IN_FLIGHT", "-1"),
    ("KVSERVE_FAULTS", "no_such_fault"),
    ("KVSERVE_REGISTRY_TTL_S", "15s"),  # read by web and workers alike (inference.settings.runtime_settings)
    ("KVSERVE_PORT", "http"),
    ("KVSERVE_LOG_FORMAT", "xml"),
])
def test_manage_py_refuses_to_start_with_a_malformed_setting(tmp_path, name, raw):
    out = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "KVSERVE_SECRETS_FILE": str(tmp_path / "s.json"), name: raw})
    assert out.returncode != 0 and f"SettingError: {name}={raw!r} is not valid" in out.stderr, out.stderr[-2000:]


def test_the_web_reads_the_settings_it_shares_with_the_workers_where_they_do(monkeypatch):
    """Ledger prefix and registry TTL: one reader, so web and workers never disagree (a TTL of 0.5 s was
    refused by the web and accepted by the workers)."""
    import importlib

    import kvserve.settings.redis as redis_settings
    from inference.worker import RuntimeOptions

    monkeypatch.setenv("KVSERVE_REGISTRY_TTL_S", "0.5")
    monkeypatch.setenv("KVSERVE_LEDGER_PREFIX", "kvs-shared")
    try:
        web, workers = importlib.reload(redis_settings), RuntimeOptions.from_env()
        assert (web.KVSERVE_REGISTRY_TTL_S, web.KVSERVE_LEDGER_PREFIX) == (0.5, "kvs-shared")
        assert (workers.registry_ttl_s, workers.prefix) == (0.5, "kvs-shared")
    finally:
        monkeypatch.undo()
        importlib.reload(redis_settings)
