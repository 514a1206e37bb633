"""/metrics on the real stack after real traffic: the histograms and counters in vLLM's vocabulary add up to what
the requests did (one observation per request, one inter-token latency per token after the first, every token
counted), KV pages are shown per tenant id while a request holds them, and every metric the Grafana dashboard
(ops/grafana/kvserve.json) queries is exported."""
import json
import re
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.stack import ROOT

DASHBOARD = ROOT / "ops" / "grafana" / "kvserve.json"
MODEL = "SmolLM2-135M-Instruct"


def scrape(stack) -> tuple[dict, set[str], str]:
    """({(sample name, labels): value}, declared family and sample names, raw text)."""
    with urllib.request.urlopen(stack.metrics_request(), timeout=30) as r:
        text = r.read().decode()
    samples, names = {}, set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + ("_total" if family.type == "counter" else ""))  # declared even with no sample yet
        for s in family.samples:
            names.add(s.name)
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, names, text


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lv), v in samples.items() if n == name and labels.items() <= dict(lv).items())


def dashboard_metric_names() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    return {name for e in exprs for name in re.findall(r"\bkvserve_[a-zA-Z0-9_]+", e)}


HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "kv_transfer_time_seconds")


@pytest.mark.timeout(600)
def test_traffic_adds_up_in_the_histograms_and_counters(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=240)
    before, _, _ = scrape(stack)
    answers = [client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0.7, seed=i,
                                              messages=[{"role": "user", "content": f"Count to {i + 3}."}])
               for i in range(3)]
    streamed = list(client.chat.completions.create(model=MODEL, max_tokens=12, stream=True,
                                                   stream_options={"include_usage": True},
                                                   messages=[{"role": "user", "content": "Name a color."}]))
    usages = [a.usage for a in answers] + [streamed[-1].usage]
    completion = sum(u.completion_tokens for u in usages)
    deadline = time.monotonic() + 60
    while True:  # each worker sends its counters and timings with its own heartbeat: wait for both workers' beats
        after, names, _ = scrape(stack)
        delta = lambda name, **labels: total(after, name, **labels) - total(before, name, **labels)  # noqa: E731
        if delta("kvserve_generation_tokens_total") >= completion and all(
                delta(f"kvserve_{h}_count") >= 4 for h in HISTOGRAMS) and all(
                delta(name, **labels) >= n for name, labels, n in (
                    ("kvserve_request_success_total", {}, 4),
                    ("kvserve_handoff_verdicts_total", {"verdict": "OK"}, 4),
                    ("kvserve_decode_verdicts_total", {"verdict": "accepted"}, 4),
                    ("kvserve_guard_checks_total", {"role": "decode"}, completion - 4),
                    ("kvserve_guard_checks_total", {"role": "prefill"}, 4),
                    ("kvserve_scrubbed_pages_total", {"role": "decode"}, 4))):
            break
        assert time.monotonic() < deadline, {h: delta(f"kvserve_{h}_count") for h in HISTOGRAMS}
        time.sleep(0.5)
    assert delta("kvserve_generation_tokens_total", model_name=MODEL) == completion
    assert delta("kvserve_prompt_tokens_total", model_name=MODEL) == sum(u.prompt_tokens for u in usages)
    for h in HISTOGRAMS:
        assert delta(f"kvserve_{h}_count", model_name=MODEL) == 4, h
    assert delta("kvserve_inter_token_latency_seconds_count") == completion - 4  # every token after the first
    reasons = [a.choices[0].finish_reason for a in answers] + [streamed[-2].choices[0].finish_reason]
    for reason in set(reasons):
        assert delta("kvserve_request_success_total", finished_reason=reason) == reasons.count(reason)
    assert delta("kvserve_handoff_verdicts_total", verdict="OK") == 4
    assert delta("kvserve_decode_verdicts_total", verdict="accepted") == 4
    assert delta("kvserve_guard_checks_total", role="decode") >= completion - 4  # one per decode step at least
    assert delta("kvserve_guard_checks_total", role="prefill") >= 4
    assert delta("kvserve_scrubbed_pages_total", role="decode") >= 4 and delta("kvserve_guard_violations_total") == 0
    # latencies are consistent with each other: the first token comes before the last
    assert 0 < delta("kvserve_time_to_first_token_seconds_sum") <= delta("kvserve_e2e_request_latency_seconds_sum")
    assert delta("kvserve_request_decode_time_seconds_sum") <= delta("kvserve_e2e_request_latency_seconds_sum")
    for h in HISTOGRAMS:  # cumulative buckets, +Inf = count
        buckets = sorted(((float(dict(lv)["le"]), v) for (n, lv), v in after.items() if n == f"kvserve_{h}_bucket"))
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
        assert buckets[-1][1] == total(after, f"kvserve_{h}_count")

    missing = dashboard_metric_names() - names
    assert not missing, f"the dashboard queries metrics /metrics does not export: {sorted(missing)}"


@pytest.mark.timeout(300)
def test_pages_held_are_shown_per_tenant_id_while_a_request_runs(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=240)
    stream = client.chat.completions.create(model=MODEL, max_tokens=300, stream=True, messages=[
        {"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    chunks = iter(stream)
    first = next(chunks)
    ((tenant_id, name),) = stack.sql("select t.id, t.name from chat_chatrequest r join tenants_tenant t "
                                     "on t.id = r.tenant_id where r.id = ?", first.id)
    # each worker's gauges are a snapshot sent with its beat: the prefill worker's may still show the prompt's
    # pages before the decode worker's first beat shows the pages it now holds
    deadline = time.monotonic() + 60
    while True:
        samples, _, text = scrape(stack)
        held = {dict(lv)["pool"]: v for (n, lv), v in samples.items()
                if n == "kvserve_kv_pages_held" and dict(lv)["tenant"] == str(tenant_id)}
        if any(pool.startswith("decode-") and n >= 1 for pool, n in held.items()):
            break
        assert time.monotonic() < deadline, f"no decode pages shown for the running request's tenant: {held}"
        time.sleep(0.3)
    assert f'tenant="{name}"' not in text and name not in text  # ids only
    for _ in chunks:  # let it finish: its pages go
        pass
    deadline = time.monotonic() + 30
    while any(n == "kvserve_kv_pages_held" and dict(lv)["tenant"] == str(tenant_id) for (n, lv) in scrape(stack)[0]):
        assert time.monotonic() < deadline
        time.sleep(0.3)
