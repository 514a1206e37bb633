"""Real processes refuse to start on a malformed setting, naming the variable: a Celery worker and the web
process on a setting the Django side reads (KVSERVE_PREFIX_SHARE_GROUPS, once a 503 on every prefill at run
time), and a worker on a setting read where the model is built, before it builds anything."""
import pytest

from tests.e2e.stack import Stack

REFUSED = "KVSERVE_PREFIX_SHARE_GROUPS='everyone' is not valid"


def exit_status(stack: Stack, name: str, proc, timeout_s: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except Exception:
        pytest.fail(f"{name} kept running with a malformed setting:\n{stack.tail(name)}")


@pytest.mark.timeout(300)
def test_worker_and_web_refuse_malformed_share_groups(own_stack):
    own_stack.env["KVSERVE_PREFIX_SHARE_GROUPS"] = "everyone"
    worker = own_stack.start_worker("prefill", queues="prefill,maintenance")
    own_stack.start_web()
    assert exit_status(own_stack, "prefill", worker) != 0 and REFUSED in own_stack.tail("prefill")
    assert exit_status(own_stack, "web", own_stack.procs["web"]) != 0 and REFUSED in own_stack.tail("web")
    assert own_stack.registry().live_workers() == []


@pytest.mark.timeout(300)
def test_worker_checks_model_side_settings_before_building_its_engine(own_stack):
    worker = own_stack.start_worker("decode", KVSERVE_CPU_GEMM="fastest")
    assert exit_status(own_stack, "decode", worker) == 3
    log = own_stack.tail("decode", 20000)
    assert "refusing to start the decode worker: KVSERVE_CPU_GEMM='fastest' is not valid" in log
    assert "torch intra-op threads" not in log  # refused before the runtime began (threads, then the model)
    assert own_stack.registry().live_workers() == []
