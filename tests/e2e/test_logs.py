"""Real processes' log lines: a worker's lines, Celery's own among them, name its role, pid and worker id (one
JSON object each under KVSERVE_LOG_FORMAT=json); the web's health probes while the stack starts are
warnings, never errors."""
import json
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.stack import Stack


def healthz_status(stack: Stack) -> int | None:
    try:
        with urllib.request.urlopen(f"{stack.url}/healthz", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None  # not listening yet


@pytest.mark.timeout(300)
def test_lines_name_their_process_and_start_up_is_no_error(tmp_path, tiny_paths):
    stack = Stack(tmp_path, KVSERVE_MODEL=str(tiny_paths["gguf"]), KVSERVE_WINDOW="2048")
    try:
        stack.manage("migrate", "--noinput")
        stack.start_web()  # before the workers: it answers 503 until both have registered
        deadline = time.monotonic() + 120
        while healthz_status(stack) != 503:
            assert time.monotonic() < deadline, stack.tail("web")
            time.sleep(0.3)
        stack.start_worker("prefill", queues="prefill,maintenance")
        stack.start_worker("decode", KVSERVE_LOG_FORMAT="json")
        stack.wait_healthy()
        (prefill,), (decode,) = stack.wait_workers("prefill", 1), stack.wait_workers("decode", 1)
        deadline = time.monotonic() + 60
        while not ("ready." in stack.tail("prefill", 200_000) and "ready." in stack.tail("decode", 200_000)):
            assert time.monotonic() < deadline, (stack.tail("prefill"), stack.tail("decode"))
            time.sleep(0.3)

        plain = [line for line in stack.tail("prefill", 200_000).splitlines() if " ready." in line]
        assert plain and f"INFO celery.apps.worker [prefill {prefill.pid} {prefill.worker_id}]" in plain[0], plain
        objects = [json.loads(line) for line in stack.tail("decode", 200_000).splitlines() if line.startswith("{")]
        ready = [o for o in objects if o["message"].endswith(" ready.")]
        assert ready and {k: ready[0][k] for k in ("logger", "role", "pid", "worker_id")} == {
            "logger": "celery.apps.worker", "role": "decode", "pid": decode.pid, "worker_id": decode.worker_id}
        assert all({"time", "level", "logger", "role", "pid", "worker_id", "message"} <= set(o) for o in objects)

        probes = [line for line in stack.tail("web", 200_000).splitlines() if "Service Unavailable: /healthz" in line]
        assert probes and all(" WARNING django.request [web " in line for line in probes), probes
    finally:
        stack.close()
