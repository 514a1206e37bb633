"""The operator dashboard in a real headless Chromium against a real stack (prefill + decode workers with the
model): chart and page map show the pools' real numbers, an injected incident is listed and quarantines its
worker, the admin releases it from the Workers page, and the page refreshes itself; the history charts drawn from
real samples and the usage table adding up to real requests' `usage`; a canary run's page. Screenshots go to
$KVSERVE_TEST_ARTIFACTS, by default test-artifacts/ at the repository root (git-ignored), kept after the run."""
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.stack import ROOT, Stack

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS") or ROOT / "test-artifacts")
NUM_PAGES, PAGE_SIZE, WINDOW = 600, 16, 8192  # the Stack's settings: 9,600 tokens >= 8,192 -> SAFE

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's Chromium (`apt-get install -y chromium`); "
                    "this test drives it through Playwright and must not be skipped")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def dash_stack(tmp_path_factory, real_model):
    s = Stack(tmp_path_factory.mktemp("dashboard-stack"))
    try:
        s.start()
        s.wait_workers("prefill", 1)
        s.wait_workers("decode", 1)
        yield s
    finally:
        s.close()


def record_incident(stack: Stack, worker_id: str) -> int:
    code = (
        "from incidents.services import incident_record\n"
        f"i = incident_record(kind='foreign_read', severity='critical', pool={worker_id!r}, worker={worker_id!r}, "
        "pages=[3, 4], reader_request='chatcmpl-e2e-reader', previous_owner_request='chatcmpl-e2e-owner', "
        "epochs=[41, 42], detected_by='e2e dashboard test')\n"
        "print('INCIDENT', i.pk, i.quarantined)\n"
    )
    line = next(ln for ln in stack.manage("shell", "-c", code).splitlines() if ln.startswith("INCIDENT"))
    _, pk, quarantined = line.split()
    assert quarantined == "True"
    return int(pk)


def text_of(page, selector: str) -> str:
    return page.locator(selector).first.text_content().strip()


def test_dashboard_shows_pools_page_maps_incident_and_release(browser, dash_stack):  # no Chromium: fail first
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    workers = {w.role: w for w in dash_stack.registry().live_workers()}
    assert set(workers) == {"prefill", "decode"}
    decode_id = workers["decode"].worker_id
    incident_id = record_incident(dash_stack, decode_id)
    assert dash_stack.registry().is_quarantined(decode_id)

    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    external = []
    page.on("request", lambda r: None if r.url.startswith(dash_stack.url) or r.url.startswith("data:")
            else external.append(r.url))

    # log in through the admin and land on the dashboard
    page.goto(f"{dash_stack.url}/admin/login/?next=/dashboard/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", dash_stack.admin_password)
    page.click("input[type=submit]")
    page.wait_for_url(f"{dash_stack.url}/dashboard/")
    page.wait_for_selector(".chart-group")

    # chart: capacity vs window side by side, SAFE, for both live workers
    groups = page.locator(".chart-group")
    assert groups.count() == 2
    for i in range(2):
        g = groups.nth(i)
        assert g.get_attribute("data-capacity") == str(NUM_PAGES * PAGE_SIZE) == "9600"
        assert g.get_attribute("data-window") == str(WINDOW)
        assert g.locator(".bar-value.capacity").text_content() == "9,600"
        assert g.locator(".bar-value.window").text_content() == "8,192"
        assert g.locator(".verdict").text_content() == "SAFE"
    assert {groups.nth(i).get_attribute("data-worker") for i in range(2)} == {w.worker_id for w in workers.values()}

    # page maps: one cell per page, all free on an idle stack
    for w in workers.values():
        block = page.locator(f'.pagemap-block[data-worker="{w.worker_id}"]')
        assert block.locator(".cell").count() == NUM_PAGES == w.num_pages
        assert block.locator(".cell.owned, .cell.dirty, .cell.lost").count() == 0
        row = page.locator(f'#workers tr[data-worker="{w.worker_id}"]')
        assert row.locator(".used").text_content() == "0" and row.locator(".free").text_content() == "600"
        assert "fp32 · KV float32 · scrub" in row.locator("td").first.text_content()  # precision and KV dtype
        mb = NUM_PAGES * 30 * 2 * PAGE_SIZE * 3 * 64 * 4 / 2 ** 20  # what the pool holds: 4 bytes a value in fp32
        assert row.locator(".capacity").text_content().endswith(f"{NUM_PAGES} pages × {PAGE_SIZE} · {mb:.1f} MB float32")

    # the incident is listed, its worker quarantined, the API limit gone
    incident = page.locator(f'.incident-row[data-incident="{incident_id}"]')
    assert incident.count() == 1 and incident.locator(".kind").text_content() == "foreign_read"
    assert decode_id in incident.text_content()
    assert "QUARANTINED" in page.locator(f'#workers tr[data-worker="{decode_id}"]').text_content()
    assert text_of(page, '[data-testid="effective-limit"] .value') == "cannot serve"
    assert text_of(page, '[data-testid="open-incidents"] .value') == "1"
    page.screenshot(path=str(ARTIFACTS / "dashboard-quarantined.png"), full_page=True)

    # the same data as JSON, with the browser's session
    api = page.request.get(f"{dash_stack.url}/api/pools/").json()
    rows = {(w["role"], w["capacity_tokens"], w["window"], w["safe"], w["num_pages"], w["free"]) for w in api["workers"]}
    assert rows == {("prefill", 9600, 8192, True, 600, 600), ("decode", 9600, 8192, True, 600, 600)}
    assert api["effective_context_limit"] is None and [i["id"] for i in api["open_incidents"]] == [incident_id]

    # release from the Workers admin page
    page.goto(f"{dash_stack.url}/admin/")
    page.click('a[href="/admin/workers/"]')
    row = page.locator(f'tr.worker-row[data-worker="{decode_id}"]')
    assert f"incident #{incident_id}: foreign_read" in row.text_content()
    row.locator('input[name="notes"]').fill("e2e: released after review")
    row.locator('input[value="Release"]').click()
    page.wait_for_selector("ul.messagelist")
    assert f"Released {decode_id}" in page.locator("ul.messagelist").text_content()
    assert not dash_stack.registry().is_quarantined(decode_id)

    # back on the dashboard: it refreshes by itself (no reload) and shows the worker serving again
    page.goto(f"{dash_stack.url}/dashboard/")
    page.wait_for_selector(".chart-group")
    first = page.locator("#dashboard").get_attribute("data-generated-at")
    page.wait_for_function(f"document.getElementById('dashboard').dataset.generatedAt !== '{first}'", timeout=15000)
    page.wait_for_function("document.querySelector('[data-testid=effective-limit] .value').textContent === '8,192'",
                           timeout=30000)  # the worker's heartbeat picks up the release
    assert "serving" in page.locator(f'#workers tr[data-worker="{decode_id}"]').text_content()
    assert page.locator(f'.incident-row[data-incident="{incident_id}"]').count() == 1  # open until resolved
    assert page.locator(".pagemap .cell").count() == 2 * NUM_PAGES
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    assert not errors, errors
    assert not external, f"the dashboard fetched from outside the stack: {external}"
    page.close()


def sample_history(stack: Stack, ago_s: float) -> None:
    """One history sample, as the beat task takes (`kvserve.history_sample`), timed `ago_s` seconds back."""
    stack.manage("shell", "-c", f"import time; from incidents.history import history_sample; "
                 f"assert history_sample(now=time.time() - {ago_s}) is not None")


def chat(stack: Stack, model: str, content: str) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{stack.url}/v1/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def log_in(page, stack: Stack, to: str) -> None:
    page.goto(f"{stack.url}/admin/login/?next={to}")
    if page.locator("#id_username").count():
        page.fill("#id_username", "admin")
        page.fill("#id_password", stack.admin_password)
        page.click("input[type=submit]")
    page.wait_for_url(f"{stack.url}{to}")


def test_metrics_endpoint_on_the_real_stack(dash_stack):
    with urllib.request.urlopen(dash_stack.metrics_request(), timeout=10) as r:
        body = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/plain")
    for w in dash_stack.registry().live_workers():
        assert f'kvserve_pool_pages{{pool="{w.worker_id}",role="{w.role}",state="free"}} 600.0' in body
    assert "kvserve_effective_context_limit_tokens" in body and "kvserve_redis_up 1.0" in body


def test_api_pools_refuses_anonymous_callers(dash_stack):
    try:
        urllib.request.urlopen(f"{dash_stack.url}/api/pools/", timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code == 403 and "staff" in json.loads(exc.read())["error"]["message"]
    else:
        pytest.fail("/api/pools/ answered an anonymous caller")
    with urllib.request.urlopen(f"{dash_stack.url}/dashboard/", timeout=10) as r:  # redirected to the login
        assert "/admin/login/" in r.url


# last in the module: its requests leave prefix-cache pages held, which the tests above count as free
def test_history_charts_usage_table_and_canary_page(browser, dash_stack):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    model = json.loads(urllib.request.urlopen(urllib.request.Request(f"{dash_stack.url}/v1/models", headers={
        "Authorization": f"Bearer {dash_stack.api_key}"}), timeout=10).read())["data"][0]["id"]
    assert model
    sample_history(dash_stack, 45)
    usages = [chat(dash_stack, model, "Name a colour.")["usage"], chat(dash_stack, model, "Name a fruit.")["usage"]]
    time.sleep(4)  # the decode worker's heartbeat sends its token counts
    sample_history(dash_stack, 30)
    sample_history(dash_stack, 15)
    run_id = int(dash_stack.manage("shell", "-c", (
        "from django.utils import timezone; from incidents.models import CanaryRun; "
        "r = CanaryRun.objects.create(started_at=timezone.now(), finished_at=timezone.now(), passed=True, checks=["
        "{'name': 'live_probes', 'passed': True, 'outcome': 'passed', 'duration_s': 0.8, 'details': {'workers': "
        "{'decode-e2e': {'role': 'decode', 'checks': {'foreign_read': {'ok': True, 'outcome': 'passed', "
        "'probe': 'read a page another request owns', 'seen': 'refused: foreign_read'}}}}}}]); print(r.pk)"
    )).split()[-1])

    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, dash_stack, "/dashboard/")

    # the history charts: drawn from the samples, a marker per sample, real rates
    page.wait_for_selector('.chart[data-chart="throughput"] circle.pt')
    for chart in ("throughput", "ttft", "errors", "refused", "queue", "preemptions", "pools"):
        assert int(page.locator(f'.chart[data-chart="{chart}"]').get_attribute("data-points")) >= 2, chart
    rates = [float(v) for v in page.locator('.chart[data-chart="throughput"] circle.pt').evaluate_all(
        "ns => ns.map(n => n.dataset.value)")]
    assert max(rates) > 0  # tokens generated between the samples, from the counters' deltas
    assert page.locator('.chart[data-chart="pools"] .series').count() == 2  # both pools
    assert "samples in this window" in text_of(page, "#history-hint")
    page.select_option("#history-window", "900")
    page.wait_for_function("document.getElementById('history-hint').textContent.startsWith('3 samples')")

    # the usage table adds up to what the API returned in `usage`
    page.wait_for_selector("#usage-table .usage-row")
    row = page.locator("#usage-table .usage-row").first
    cells = [c.strip() for c in row.locator("td").all_text_contents()]
    assert cells[1:6] == [f"{n:,}" for n in (2, 2, sum(u["prompt_tokens"] for u in usages),
                                              sum(u["completion_tokens"] for u in usages),
                                              sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages))]
    assert "/dashboard/usage.csv?from=" in page.locator("#usage-csv").get_attribute("href")
    page.screenshot(path=str(ARTIFACTS / "dashboard-history-usage.png"), full_page=True)

    # the latest canary run links its page: per worker, each probe and what it saw
    page.wait_for_selector("a.canary-run-link")
    page.click("a.canary-run-link")
    page.wait_for_url(f"{dash_stack.url}/dashboard/canary/{run_id}/")
    probe = page.locator('.probe-row[data-worker="decode-e2e"][data-probe="foreign_read"]')
    assert probe.get_attribute("data-outcome") == "passed" and "refused: foreign_read" in probe.text_content()
    page.screenshot(path=str(ARTIFACTS / "canary-run.png"), full_page=True)
    assert not errors, errors
    page.close()
