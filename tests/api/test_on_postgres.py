"""The API tests that touch what the database stores, run again on PostgreSQL (the production database, which
refuses text SQLite keeps: U+0000 in text and jsonb): a pytest of their own on a throwaway database, since
one process's Django settings name one database."""
import os
import subprocess
import sys

import pytest

from kvserve.paths import BASE_DIR

ON_POSTGRES = [
    "tests/api/test_storable.py",
    "tests/api/test_chat_api.py", "tests/api/test_completions_api.py", "tests/api/test_tenant_usage.py",
    "-k", "storable or openai_shaped or stream_is_openai or worker_failure or detail or other_tenants or "
          "stream_replay or prompt_hash or retention or legacy_shape or token_ids or chat_logprobs or "
          "usage_adds_up or counted_by_code or fair_share_429",  # -k: every file
]


@pytest.mark.timeout(300)
def test_api_tests_pass_on_postgres(postgres):
    env = {**os.environ, "DATABASE_URL": postgres.create_database("api"), "DJANGO_SETTINGS_MODULE": "kvserve.settings"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ON_POSTGRES],
                         cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=280)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and " passed" in summary and "error" not in summary, run.stdout[-6000:] + run.stderr[-2000:]
