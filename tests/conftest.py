"""Shared test fixtures. Redis tests use DB 15 (KVSERVE_TEST_REDIS_URL) and a unique key prefix per test,
and delete only their own keys: never FLUSHDB/FLUSHALL.
"""
import os
import time
import uuid

import pytest
import redis

from inference.registry import Registry, WorkerInfo

TEST_REDIS_URL = os.environ.get("KVSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


# --- worker registry (kvserve.workers / inference.registry) ---------------------------------


@pytest.fixture
def registry_redis():
    client = redis.Redis.from_url(TEST_REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def registry_prefix(registry_redis):
    prefix = f"kvstest-{uuid.uuid4().hex[:12]}"
    yield prefix
    keys = list(registry_redis.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        registry_redis.delete(*keys)


@pytest.fixture
def registry(registry_redis, registry_prefix) -> Registry:
    return Registry(registry_redis, prefix=registry_prefix, ttl_s=15)


@pytest.fixture
def registry_settings(settings, registry_prefix):
    """Points the Django side (healthz, incident_record's quarantine) at the test Redis and prefix."""
    settings.REDIS_URL = TEST_REDIS_URL
    settings.KVSERVE_LEDGER_PREFIX = registry_prefix
    return settings


@pytest.fixture
def make_worker():
    """WorkerInfo factory: make_worker("decode", worker_id="d1", capacity_tokens=4096, ...)."""

    def make(role: str = "prefill", **overrides) -> WorkerInfo:
        fields = dict(
            worker_id=f"{role}-{uuid.uuid4().hex[:6]}", role=role, host="testhost", pid=os.getpid(),
            num_pages=512, page_size=16, capacity_tokens=8192, window=8192,
            model_fingerprint="sha256:test", dtype="float32", device="cpu",
            attention_backend="sdpa", scrub_policy="zero", faults=[], started_at=time.time(),
        )
        fields.update(overrides)
        return WorkerInfo(**fields)

    return make


# --- page ledger (inference.ledger) -----------------------------------------------------------


@pytest.fixture
def redis_client():
    """Real Redis, database 15 by default. A Redis that is down is an error, never a skip."""
    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as e:
        raise RuntimeError(
            f"Redis at {TEST_REDIS_URL} is not answering; start it with `redis-server --daemonize yes "
            "--bind 127.0.0.1 --port 6379 --save '' --appendonly no` or point KVSERVE_TEST_REDIS_URL at one"
        ) from e
    yield client
    client.close()


@pytest.fixture
def ledger_prefix(redis_client):
    """A key prefix of this test's own; its keys, and only its keys, are deleted afterwards."""
    prefix = f"kvstest:{uuid.uuid4().hex[:10]}"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        redis_client.delete(*keys)


# --- models (inference.loader): loaded once per test process --------------------------------


@pytest.fixture(scope="session")
def real_model():
    """The default SmolLM2-135M-Instruct Q4_1, converted once and then read from the weights cache."""
    from inference.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory):
    """A tiny random-weight Llama written as GGUF (F32 and Q8_0) and as an HF directory."""
    from inference.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model(tiny_paths):
    from inference.loader import load_model

    return load_model(tiny_paths["gguf"])


# --- PostgreSQL (tests/postgres.py): a throwaway database per use, all dropped at the end of the run ---------


@pytest.fixture(scope="session")
def postgres():
    from tests.postgres import postgres_server_get

    server = postgres_server_get()
    try:
        yield server
    finally:
        server.drop_all()
