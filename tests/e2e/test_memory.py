"""A serving worker's memory across canary runs, on a real stack: the scheduled canary task (`kvserve.canary`,
maintenance queue) runs in the prefill worker's own process; its sandbox (inference.sandbox) must leave that
process's RSS where it found it, and not swell it while it runs (issue 20, problem 9)."""
import threading

import openai
import pytest

from bench.memory import canary_task
from inference.memory import rss_bytes

RUNS = 5


class RssWatch:
    """The highest VmRSS of process `pid`, sampled every 50 ms while the block runs."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def __enter__(self):
        self.peak = rss_bytes(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.timeout(900)
def test_canary_runs_leave_the_serving_workers_rss_steady(stack):
    pid = stack.procs["prefill"].pid
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=240)
    model = client.models.list().data[0].id
    for _ in range(2):  # warm-up: the worker has served (prefill, handoff, decode) before it is measured
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8)
    baseline = rss_bytes(pid)
    last = stack.sql("select coalesce(max(id), 0) from incidents_canaryrun")[0][0]
    after, peaks = [], []
    for _ in range(RUNS):
        with RssWatch(pid) as watch:
            last, passed = canary_task(stack, last)
        assert passed.get("selftest") is True, (passed, stack.tail("prefill"))
        after.append(rss_bytes(pid))
        peaks.append(watch.peak)
    report = {"baseline_mb": baseline >> 20, "after_mb": [a >> 20 for a in after], "peak_mb": [p >> 20 for p in peaks]}
    print("prefill worker RSS across canary runs:", report)
    # retained after each run (the first included: the sandbox brings no model of its own to warm up) ...
    assert max(after) <= baseline * 1.05, report
    # ... and no step while it runs: a second model (+0.5 GB packed per sandbox engine) would show here
    assert max(peaks) <= baseline * 1.10, report
