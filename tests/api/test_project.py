"""Project plumbing: generated secrets, Celery queue routing and delivery settings."""
import json
import stat
from concurrent.futures import ThreadPoolExecutor

from kvserve import celery_app
from kvserve.secrets import secret_get


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
