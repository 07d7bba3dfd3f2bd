"""The operator's pages against a real cluster: history charts read from a real Prometheus (Debian's, scraping a
running gateway and controller), a node's page, and its logs followed live, through Flask's test client and in
headless Chromium at a phone's width.

Prometheus here scrapes every second under job names of the test's own, not the deployment's: the charts'
queries must not depend on job labels.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
from playwright.sync_api import sync_playwright

from llmgw import settings, store
from llmgw.people import accounts, keys
from llmgw.procs import free_port, wait_for
from llmgw.web import history, prometheus
from llmgw.web.app import GatewayApp
from tests import promstack
from tests.cluster import Agent, Controller
from tests.conftest import Gateway, chromium, make_key, post
from tests.promstack import Prometheus
from tests.test_browser_pages import fits_the_screen, signed_in
from tests.test_fabric_discovery import FABRIC_ENV, ib_port
from tests.test_pages import sign_in

PASSWORD = "a long enough password"
# On the CPU node only: the GPU node is there for its cards (replayed nvidia-smi output), and runs nothing.
MODEL = {"name": "simmy", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
         "profiles": [{"engine": "sim", "args": ["--ttft-ms", "20", "--tokens-per-s", "0"],
                       "node_selector": {"kind": "cpu"}}]}
@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opspages")
    url = f"sqlite:///{tmp}/cluster.db"
    made = []
    try:
        c = Controller(tmp, store_url=url, models=[MODEL])
        made.append(c)
        made.append(Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"), labels={"kind": "cpu"}))
        made.append(Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "gpu-1", c.issue_key("gpu-1"), labels={"kind": "gpu"},
                          nvidia_smi_capture="nvidia-smi-1xa100-busy.csv"))
        # An HGX node on an InfiniBand fabric (fixture sysfs, subnet managers and topology: its fabric section,
        # the NVLink matrix, /admin/fabrics).
        ib_port(tmp, "mlx5_0")
        ib_port(tmp, "mlx5_1", state="1: DOWN", phys="2: Polling")
        made.append(Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "hgx-1", c.issue_key("hgx-1"), labels={"kind": "gpu"},
                          nvidia_smi_capture="nvidia-smi-8xh100.csv", env=FABRIC_ENV,
                          fabrics=[{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"]}],
                          agent__infiniband_dir=str(tmp / "sys/class/infiniband")))
        engine = store.open_store(url)
        accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
        engine.dispose()
        # Before the gateway starts, so that every worker knows it: made later, one worker that had not yet heard
        # of it answered 401 on a loaded machine.
        key = make_key(url)
        prom = Prometheus(tmp)
        made.append(prom)
        prom.scrape("test-ctl", f"127.0.0.1:{c.metrics_port}")
        pages = {"gateway.controller": f"127.0.0.1:{c.gateway_port}",
                 "gateway.controller_admin": f"127.0.0.1:{c.admin_port}",
                 "controller.keys_dir": c.values["controller.keys_dir"], "monitoring.prometheus": prom.url}
        gw = Gateway(tmp, url, workers=2, gateway__key_file=c.gateway_key_file(),
                     **{k.replace(".", "__"): v for k, v in pages.items()})
        made.append(gw)
        prom.scrape("test-gw", f"127.0.0.1:{gw.metrics_port}")
        chat = {"model": "simmy", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        wait_for("the gateway to serve simmy", 60,
                 lambda: post(gw.url + "/v1/chat/completions", chat, key)[0] == 200, interval=0.2)
        # Twice: a rate counts only what rises between two scrapes, so the second round comes once Prometheus
        # has seen every series the first made.
        for round_ in ("first", "second"):
            for i in range(6):
                assert post(gw.url + "/v1/chat/completions", {**chat, "stream": i % 2 == 0}, key)[0] == 200
            if round_ == "first":
                for series in ("llmgw_requests_total", "llmgw_ttft_seconds_bucket", "llmgw_endpoint_kv_cache_usage",
                               "llmgw_node_cpu_utilization_percent", "llmgw_shard_memory_bytes",
                               "llmgw_gpu_utilization_percent"):
                    wait_for(f"Prometheus to have {series}", 60, lambda series=series: prom.query(series), interval=0.5)
        for rate in ("rate(llmgw_requests_total[1m]) > 0", "rate(llmgw_ttft_seconds_count[1m]) > 0"):
            wait_for(rate, 60, lambda rate=rate: prom.query(rate), interval=0.5)
        app = GatewayApp(settings.load(None, {"store.url": url, **pages}), key_source=keys)
        app.pages.testing = True
        with sync_playwright() as p:
            browser = chromium(p)
            yield {"c": c, "gw": gw, "prom": prom, "app": app, "browser": browser, "tmp": tmp, "key": key}
            browser.close()
        app.runtime.engine.dispose()
    finally:
        for thing in reversed(made):
            thing.stop()


@pytest.fixture
def client(ops):
    client = ops["app"].pages.test_client()
    sign_in(client, "root@example.org", PASSWORD)
    return client


def shard_of(ops) -> str:
    return next(r["shard_id"] for r in ops["c"].replicas("simmy"))


def svg_of(page: str, title: str) -> str:
    """The chart under the heading TITLE, up to the next heading."""
    match = re.search(rf"<h3>{re.escape(title)}</h3>\s*(.*?)(?=<h3>|</section>)", page, re.S)
    assert match, f"no chart {title!r}"
    return match.group(1)


def what_prometheus_holds(ops) -> dict:
    """The gateway's request counts and scrapes over the last minutes, and the requests chart's own query as
    the page asks it: what a failing chart test prints."""
    prom, end, span = ops["prom"], int(time.time()), history.WINDOWS["1h"]
    step = span // history.POINTS
    query = history.query_of(history.CLUSTER[0], step)
    return {"at": end, "samples": prom.query("llmgw_requests_total[5m]"), "up": prom.query("up[5m]"),
            "chart": prom.api("query_range", query=query, start=end - span + step, end=end, step=step)["result"]}


def test_the_cluster_page_draws_its_history_from_prometheus(ops, client):
    page = client.get("/admin").data.decode()
    requests = svg_of(page, "Requests a minute, by model")
    # Once on CI this chart was empty although the fixture had seen the requests' rate: the message says
    # what Prometheus held.
    assert "<svg" in requests and "<rect" in requests and "simmy" in requests, what_prometheus_holds(ops)
    ttft = svg_of(page, "Time to first token, 95th percentile, by model")
    assert "<svg" in ttft and ("<polyline" in ttft or "<circle" in ttft) and "simmy" in ttft and "NaN" not in ttft
    use = svg_of(page, "GPU or CPU use, by node")
    assert "n1 (CPU)" in use and "gpu-1 (GPU)" in use and ">100%<" in use  # a percentage's axis is fixed at 100
    kv = svg_of(page, "KV cache in use, by replica")
    assert shard_of(ops) in kv and "<svg" in kv
    # A window to choose; an unknown one is the default, not an error.
    week = client.get("/admin?window=7d").data.decode()
    assert '<option value="7d" selected>' in week and "<svg" in svg_of(week, "Requests a minute, by model")
    assert '<option value="1h" selected>' in client.get("/admin?window=%00").data.decode()
    # The part that refreshes every five seconds does not ask Prometheus.
    assert "History" not in client.get("/admin?partial=1").data.decode()
    assert 'href="/admin/nodes/n1"' in page


def test_the_node_page_shows_the_node_and_its_last_hour(ops, client):
    page = client.get("/admin/nodes/n1").data.decode()
    shard = shard_of(ops)
    for text in ("Hardware", "CPUs", "available of", "free of", "None: the node found no GPU",
                 "sim", "Replicas here", shard, "The doctor's findings", "Read its logs",
                 "which also answers fabric-test, fabric-scan"):
        assert text in page, text
    assert "<svg" in svg_of(page, "CPU use") and "this node" in svg_of(page, "CPU use")
    assert shard in svg_of(page, "Memory of each replica&#39;s engine")
    assert "<h3>GPU use, by GPU</h3>" not in page  # a node without GPUs has no GPU chart, not an empty one
    assert "{" not in page.split("<main>")[1].split("History")[0]  # no raw data structure shown
    gpu = client.get("/admin/nodes/gpu-1").data.decode()
    for text in ("NVIDIA A100-SXM4-80GB", "58.6 GiB of 80 GiB", "97%", "Warning:</strong> GPU 0 has 60000 of 81920 MiB "
                 "in use already", "No replica runs here."):
        assert text in gpu, text
    assert "GPU 0" in svg_of(gpu, "GPU use, by GPU")
    partial = client.get("/admin/nodes/n1?partial=1").data.decode()
    assert "<html" not in partial and "Hardware" in partial and "History" not in partial
    missing = client.get("/admin/nodes/nobody")
    assert missing.status_code == 404 and "No node nobody has registered" in missing.data.decode()


def test_a_fabric_nodes_page_shows_its_ports_fabrics_and_nvlink_and_the_fabric_pages_group_them(ops, client):
    wait_for("hgx-1 to say its fabrics", 60, lambda: ops["c"].nodes().get("hgx-1", {}).get("facts", {}).get("fabrics"))
    page = client.get("/admin/nodes/hgx-1").data.decode()
    for text in ("<h3>NVLink</h3>", "NV18", "<h2>Fabrics</h2>", "ib-a</a>: mlx5_0 at 400 Gb/s, on sm:0x248a0703005a0012",
                 "mlx5_1/1", "DOWN (Polling)"):
        assert text in page, text
    fabrics = client.get("/admin/fabrics").data.decode()
    for text in ("<h2>ib-a</h2>", "sm:0x248a0703005a0012", "0x248a0703005abcde (master, priority 15)", "hgx-1",
                 "all at rate"):
        assert text in fabrics, text
    assert "No node's cards have joined a multi-node NVLink domain." in client.get("/admin/nvlink").data.decode()
    cluster = client.get("/admin").data.decode()
    assert '1 node declares a fabric for replicas over several nodes: <a href="/admin/fabrics">' in cluster
    assert "{" not in page.split("<main>")[1].split("History")[0]  # no raw data structure shown


def test_the_logs_page_reads_names_the_node_lists_and_follows_with_a_cursor(ops, client):
    page = client.get("/admin/nodes/n1/logs").data.decode()
    assert "registered with the controller" in page and "The agent's log on n1" in page
    assert client.get("/admin/nodes/n1/logs").headers["Cache-Control"] == "no-store"
    cursor = re.search(r'data-cursor="(\d+)"', page).group(1)
    assert f'?source={shard_of(ops)}' in page
    more = client.get(f"/admin/nodes/n1/logs/more?source=agent&after={cursor}").get_json()
    assert more["problem"] is None and isinstance(more["cursor"], int) and more["skipped"] is False
    engine = client.get(f"/admin/nodes/n1/logs?source={shard_of(ops)}").data.decode()
    assert "llmgw: starting" in engine
    for source, said in (("/var/log/dpkg", "never a path"), ("nope", "No source &#39;nope&#39; on n1")):
        refused = client.get(f"/admin/nodes/n1/logs?source={source}").data.decode()
        assert said in refused and 'id="log"' not in refused, source
    assert "never a path" in client.get("/admin/nodes/n1/logs/more?source=..%2Fx&after=1").get_json()["problem"]


def test_every_failure_of_prometheus_is_a_sentence(ops, client):
    base = ops["prom"].url
    now = time.time()

    def refusal(url, query="llmgw_node_load", **bounds) -> str:
        with pytest.raises(prometheus.Unavailable) as e:
            prometheus.query_range(url, query, now - 3600, now, 60, **bounds)
        return str(e.value)

    assert "refused a chart's query (bad_data, 400)" in refusal(base, "sum(")
    closed = f"http://127.0.0.1:{free_port()}"
    assert "cannot be reached from this gateway" in refusal(closed)
    # monitoring.prometheus may be written HOST:PORT, as other addresses are.
    assert "cannot be reached" in history.charts(closed.removeprefix("http://"), "1h")["problem"]
    assert "is not Prometheus' query API (it answered 404)" in refusal(f"http://127.0.0.1:{ops['c'].metrics_port}")
    assert "more than 100 bytes" in refusal(base, "llmgw_node_load", most_bytes=100)
    # A Prometheus that hangs: the page waits the bound, and says so in one sentence for every chart.
    ops["prom"].proc.send_signal(signal.SIGSTOP)
    try:
        wait_for("Prometheus to stop", 30, lambda: ops["prom"].state() == "T")
        started = time.monotonic()
        page = client.get("/admin").data.decode()
        took = time.monotonic() - started
        state = ops["prom"].state()
    finally:
        ops["prom"].proc.send_signal(signal.SIGCONT)
    assert f"Prometheus at {base} did not answer within 5 s" in page, (state, took, page.split('id="history"')[1][:2000])
    assert took < 20
    assert page.count('class="problem"') == 1 and "<svg" not in page.split('id="history"')[1]


def test_the_charts_ask_only_for_series_llmgw_emits(tmp_path):
    emitted = set(promstack.emitted(tmp_path))
    for chart in history.CLUSTER + history.NODE:
        used = {name for name in re.findall(r"\bllmgw_[a-z_]+", chart.query)}
        assert used and used <= emitted, (chart.title, used - emitted)
        assert "job" not in chart.query and "instance" not in chart.query, chart.title


@pytest.mark.parametrize("window", list(history.WINDOWS))
def test_each_rate_looks_back_past_its_step_so_no_rise_falls_between_two(monkeypatch, window):
    # Rates over exactly a step tile time: six requests made between a step's last scrape and the next
    # step's first were in no bar, and the chart of a cluster that served them showed nothing (seen once).
    asked = []
    monkeypatch.setattr(prometheus, "query_range", lambda base, query, start, end, step: asked.append(
        (query, step)) or [])
    history.charts("127.0.0.1:9090", window)
    rates = [(re.search(r"\[(\d+)s\]", query), step) for query, step in asked if "rate(" in query]
    assert rates and all(found and int(found.group(1)) >= step + history.SCRAPE for found, step in rates)


@pytest.mark.parametrize("path", ["/admin", "/admin/nodes/n1", "/admin/nodes/gpu-1", "/admin/nodes/n1/logs",
                                  "/admin/nodes/hgx-1", "/admin/fabrics", "/admin/nvlink"])
def test_the_pages_fit_a_phone_and_break_no_rule_of_their_policy(ops, path):
    context, page = signed_in(ops)
    refused = []
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(ops["gw"].url + path)
    page.wait_for_load_state("load")
    page.screenshot(path=str(ops["tmp"] / f"phone-{path.strip('/').replace('/', '-')}.png"), full_page=True)
    assert fits_the_screen(page), path
    if path == "/admin":
        assert page.locator("#history svg.chart").count() == 4
    assert refused == []
    context.close()


def test_the_cluster_page_leads_to_the_node_and_its_logs_follow_live(ops):
    context, page = signed_in(ops)
    page.set_default_timeout(60_000)
    page.goto(ops["gw"].url + "/admin")
    page.click("#cluster a[href='/admin/nodes/n1']")
    page.wait_for_url("**/admin/nodes/n1")
    page.click("text=Read its logs")
    page.wait_for_url("**/admin/nodes/n1/logs")
    assert "Following" in page.inner_text("#follow-status")
    # Something new happens on the node: a model added, which the agent starts and logs.
    (ops["tmp"] / "more.toml").write_text('name = "more"\nsource = "/dev/null"\nscaling = {min = 1, max = 1}\n'
                                          '[[profiles]]\nengine = "sim"\nnode_selector = {kind = "cpu"}\n')
    added = ops["c"].ctl("model", "add", "-f", str(ops["tmp"] / "more.toml"), "--no-source-check")
    assert added.returncode == 0, added.stderr
    # Polled from here: wait_for_function evaluates its string in the page, which the pages' CSP forbids.
    wait_for("the agent's new lines on the page", 60, lambda: "(more): ready" in page.inner_text("#log"), interval=0.5)
    assert page.inner_text("#log").count("registered with the controller") == 1  # added after, not reloaded
    page.click("#follow-pause")
    assert "Paused" in page.inner_text("#follow-status")
    context.close()

