"""deploy/monitoring/ as an operator installs it, checked by the tools that will read it.

Debian's promtool checks the Prometheus configuration and the rules and runs every rule's unit test
(tests/monitoring/); amtool checks the Alertmanager configuration and its routes. Every series a
rule, a unit test or the dashboard names is one the code emits, with the labels it has: gathered
from the gateway's metric objects, a real controller's and node_exporter's exposition and the
mirror's collector. Then a real Prometheus scrapes a running cluster (controller, agent, gateway,
mirror, node_exporter), the series are read back through its query API, every dashboard query
runs there, and stopping the agent makes NodeNotReady go pending, fire, and reach a real
Alertmanager.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import yaml

from llmgw.procs import free_port, http_status, wait_for
from tests.cluster import Agent, Controller
from tests.conftest import ROOT, Gateway, make_key, post, stop_process, write_config
from tests.promstack import AMTOOL, PROMTOOL, SCRAPED, Alertmanager, NodeExporter, Prometheus, emitted, need

BUNDLE = os.path.join(ROOT, "deploy", "monitoring")
RULE_FILES = sorted(glob.glob(os.path.join(BUNDLE, "*-rules.yml")))
RULE_TESTS = sorted(glob.glob(os.path.join(ROOT, "tests", "monitoring", "*.test.yml")))
DASHBOARD = os.path.join(BUNDLE, "grafana", "llmgw-cluster.json")
SELECTOR = re.compile(r"\b((?:llmgw|node)_[a-zA-Z0-9_:]+|up)\b(?:\s*(\{[^}]*\}))?")
MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
WAIT = 60.0


def load(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) if path.endswith((".yml", ".yaml")) else json.load(f)


def rules() -> list[dict]:
    """Every alert rule of the bundle."""
    return [rule for path in RULE_FILES for group in load(path)["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in load(DASHBOARD)["panels"] for target in panel.get("targets", ())]


def promtool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([need(PROMTOOL), *args], capture_output=True, text=True, timeout=120)


def problems_with(expr: str, series: dict[str, set[str]]) -> list[str]:
    """What EXPR names that the code does not emit: series, labels in its matchers, labels it groups by."""
    found, known = [], set(SCRAPED)
    for name, matchers in SELECTOR.findall(expr):
        if name not in series:
            found.append(f"{name} is not emitted")
            continue
        known |= series[name] | ({"le"} if name.endswith("_bucket") else set())
        for label in MATCHER.findall(matchers or ""):
            if label not in series[name] | SCRAPED:
                found.append(f"{name} has no label {label}")
    for group in GROUPING.findall(expr):
        for label in filter(None, (part.strip() for part in group.split(","))):
            if label not in known:
                found.append(f"no series of it has the label {label} it groups or matches on")
    return found


# --- the files, checked by the tools that read them ----------------------------------------------

def test_promtool_and_amtool_accept_the_bundle():
    run = promtool("check", "config", "--syntax-only", os.path.join(BUNDLE, "prometheus.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    run = promtool("check", "rules", *RULE_FILES)
    assert run.returncode == 0 and "FAILED" not in run.stdout + run.stderr, run.stdout + run.stderr
    run = subprocess.run([need(AMTOOL), "check-config", os.path.join(BUNDLE, "alertmanager.yml")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    # Prometheus reads every rule file the bundle has, by the one glob it is installed under.
    (pattern,) = load(os.path.join(BUNDLE, "prometheus.yml"))["rule_files"]
    assert all(re.fullmatch(pattern.rsplit("/", 1)[1].replace("*", ".*"), os.path.basename(p)) for p in RULE_FILES)


def test_every_rule_fires_in_its_unit_tests_and_says_what_to_do():
    for rule in rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), name  # Alertmanager routes and inhibits on it
        assert len(rule["annotations"]["summary"]) > 40, name
    # Each rule, told apart by its own labels (the causes of RequestsBeingRejected), fires in a unit test.
    fired = [{**alert["exp_labels"]} for path in RULE_TESTS for test in load(path)["tests"]
             for case in test.get("alert_rule_test", ()) for alert in case.get("exp_alerts") or ()]
    for rule in rules():
        wanted = {"alertname": rule["alert"], **rule["labels"]}
        assert any(wanted.items() <= alert.items() for alert in fired), f"no unit test fires {wanted}"
    tested = {os.path.normpath(os.path.join(os.path.dirname(path), f)) for path in RULE_TESTS
              for f in load(path)["rule_files"]}
    assert tested == set(RULE_FILES)
    run = promtool("test", "rules", *RULE_TESTS)
    assert run.returncode == 0, run.stdout + run.stderr


def test_alertmanager_sends_nothing_and_routes_critical_apart():
    config = load(os.path.join(BUNDLE, "alertmanager.yml"))
    # No receiver has anywhere to send: where alerts go is the operator's choice, with credentials.
    assert all(set(receiver) == {"name"} for receiver in config["receivers"])

    def receiver(*labels):
        run = subprocess.run([need(AMTOOL), "config", "routes", "test",
                              f"--config.file={os.path.join(BUNDLE, 'alertmanager.yml')}", *labels],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        return run.stdout.strip()

    assert receiver("alertname=ModelHasNothingServing", "severity=critical", "model=qwen") == "critical"
    assert receiver("alertname=NodeNotReady", "severity=warning", "node=n1") == "warnings"


def test_rules_tests_and_dashboard_name_only_series_the_code_emits(tmp_path):
    series = emitted(tmp_path)
    for rule in rules():
        assert not problems_with(rule["expr"], series), (rule["alert"], problems_with(rule["expr"], series))
        for text in rule["annotations"].values():  # a summary may query, as NodeNotReady's does
            for name, _ in SELECTOR.findall(text):
                assert name in series, (rule["alert"], name)
    for expr in dashboard_queries():
        assert not problems_with(expr, series), (expr, problems_with(expr, series))
    # The unit tests' input is what the code exports: each series with exactly its labels.
    for path in RULE_TESTS:
        for test in load(path)["tests"]:
            for given in test["input_series"]:
                name, _, labels = given["series"].partition("{")
                assert name in series, (path, name)
                assert set(MATCHER.findall(labels)) - SCRAPED == series[name], (path, given["series"], series[name])


def test_the_dashboard_is_one_grafana_provisions(tmp_path):
    board = load(DASHBOARD)
    source = load(os.path.join(BUNDLE, "grafana", "datasource.yml"))["datasources"][0]
    (provider,) = load(os.path.join(BUNDLE, "grafana", "dashboards.yml"))["providers"]
    assert source["type"] == "prometheus" and provider["type"] == "file"
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int) and board["refresh"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(set(ids)) == len(ids)
    taken: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["w"] > 0 and box["x"] + box["w"] <= 24 and box["h"] > 0, panel["title"]
        cells = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("stat", "timeseries") and panel["description"], panel["title"]
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        assert all(target["datasource"]["uid"] == source["uid"] and target["expr"] for target in panel["targets"])
    # Every query is PromQL Prometheus parses: loaded as recording rules, promtool checks each one.
    recorded = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": expr}
                                                            for i, expr in enumerate(dashboard_queries())]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(recorded))
    run = promtool("check", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr


# --- a real Prometheus and Alertmanager ----------------------------------------------------------

def test_alertmanager_holds_back_what_a_not_ready_node_or_a_leaderless_control_plane_explains(tmp_path):
    manager = Alertmanager(tmp_path, os.path.join(BUNDLE, "alertmanager.yml"))
    try:
        def alert(name, severity, **labels):
            return {"labels": {"alertname": name, "severity": severity, **labels}}

        manager.post([alert("NodeNotReady", "warning", node="n1"),
                      alert("EndpointMetricsStale", "warning", node="n1", replica="r1"),
                      alert("EndpointBreakerOpen", "warning", node="n2", replica="r2")])

        def states():
            return {a["labels"]["alertname"] + "/" + a["labels"].get("node", ""): a["status"]["state"]
                    for a in manager.alerts()}

        wait_for("the alerts taken in", WAIT, lambda: len(states()) == 3)
        # Only the replica on the node that is not ready is held back.
        wait_for("the inhibition", WAIT, lambda: states() == {"NodeNotReady/n1": "active",
                                                               "EndpointMetricsStale/n1": "suppressed",
                                                               "EndpointBreakerOpen/n2": "active"})
        manager.post([alert("ControlPlaneUnreachable", "critical"), alert("ModelHasNothingServing", "critical",
                                                                          model="qwen")])
        wait_for("every warning held back, no critical", WAIT, lambda: states() == {
            "NodeNotReady/n1": "suppressed", "EndpointMetricsStale/n1": "suppressed",
            "EndpointBreakerOpen/n2": "suppressed", "ControlPlaneUnreachable/": "active",
            "ModelHasNothingServing/": "active"})
    finally:
        manager.stop()


def scrape_config(tmp_path, targets: dict[str, str], alertmanager: str, hold: dict[str, str]) -> str:
    """The shipped prometheus.yml and rules with this test's TARGETS (job -> host:port), every second, and
    the alerts of HOLD (name -> duration) holding that long rather than their minutes."""
    config = load(os.path.join(BUNDLE, "prometheus.yml"))
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    assert {job["job_name"] for job in config["scrape_configs"]} == set(targets)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    (tmp_path / "rules").mkdir()
    for path in RULE_FILES:
        loaded = load(path)
        for group in loaded["groups"]:
            for rule in group["rules"]:
                if rule["alert"] in hold:
                    rule["for"] = hold[rule["alert"]]
        with open(tmp_path / "rules" / os.path.basename(path), "w") as f:
            yaml.safe_dump(loaded, f)
    config["rule_files"] = [str(tmp_path / "rules" / "*-rules.yml")]
    with open(tmp_path / "prometheus.yml", "w") as f:
        yaml.safe_dump(config, f)
    return str(tmp_path / "prometheus.yml")


def start_mirror(tmp_path) -> tuple[subprocess.Popen, int]:
    metrics = free_port()
    config = write_config(tmp_path / "mirror.toml", {
        "mirror.dir": str(tmp_path / "models"), "mirror.listen": f"127.0.0.1:{free_port()}",
        "mirror.api_listen": f"127.0.0.1:{free_port()}", "mirror.metrics_listen": f"127.0.0.1:{metrics}"})
    with open(tmp_path / "mirror.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", config],
                                stdout=log, stderr=subprocess.STDOUT)
    wait_for("the mirror's metrics", 30, lambda: http_status(f"http://127.0.0.1:{metrics}/metrics") == 200,
             alive=lambda: proc.poll() is None)
    return proc, metrics


def test_prometheus_reads_a_running_cluster_and_an_agent_stopped_fires_node_not_ready(tmp_path):
    model = {"name": "simmy", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
             "profiles": [{"engine": "sim", "args": ["--ttft-ms", "5", "--tokens-per-s", "0"]}]}
    stops = []  # what to stop at the end, last started first
    try:
        c = Controller(tmp_path, models=[model])
        stops.append(c.stop)
        agent = Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"),
                      nvidia_smi_capture="nvidia-smi-2xl40s-old-driver.csv")
        stops.append(agent.stop)
        store_url = c.values["store.url"]
        gw = Gateway(tmp_path, store_url, workers=2, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                     gateway__key_file=c.gateway_key_file(), routing__max_outstanding=4)
        stops.append(gw.stop)
        mirror, mirror_metrics = start_mirror(tmp_path)
        stops.append(lambda: stop_process(mirror))
        exporter = NodeExporter(tmp_path)
        stops.append(exporter.stop)
        manager = Alertmanager(tmp_path, os.path.join(BUNDLE, "alertmanager.yml"))
        stops.append(manager.stop)
        # NodeNotReady holds ten seconds here instead of two minutes: long enough to be seen pending.
        config = scrape_config(tmp_path, {"llmgw-controller": f"127.0.0.1:{c.metrics_port}",
                                          "llmgw-gateway": f"127.0.0.1:{gw.metrics_port}",
                                          "llmgw-mirror": f"127.0.0.1:{mirror_metrics}",
                                          "monitoring-host": f"127.0.0.1:{exporter.port}"},
                               f"127.0.0.1:{manager.port}", {"NodeNotReady": "10s"})
        prom = Prometheus(tmp_path, config)
        stops.append(prom.stop)

        # A second model, added while running, to be removed later.
        (tmp_path / "extra.toml").write_text('name = "extra"\nsource = "/dev/null"\nscaling = {min = 1, max = 1}\n'
                                             '[[profiles]]\nengine = "sim"\n')
        assert c.ctl("model", "add", "-f", str(tmp_path / "extra.toml")).returncode == 0
        wait_for("the replicas ready", 120, lambda: c.ready("simmy") and c.ready("extra"), interval=0.2)
        (replica,) = c.ready("simmy")
        (extra,) = c.ready("extra")
        key = make_key(store_url)
        chat = {"model": "simmy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        wait_for("an answer through the gateway", WAIT,
                 lambda: post(gw.url + "/v1/chat/completions", chat, key)[0] == 200)
        for stream in (False, False, True, True, True):  # a stream's first token is timed (llmgw_ttft_seconds)
            assert post(gw.url + "/v1/chat/completions", {**chat, "stream": stream}, key)[0] == 200

        # Every role scraped, and the series read back as the cluster is.
        wait_for("every target up", WAIT, lambda: {r["metric"]["job"] for r in prom.query("up == 1")} == {
            "llmgw-controller", "llmgw-gateway", "llmgw-mirror", "monitoring-host"})
        wait_for("the six requests", WAIT, lambda: (prom.value(
            'sum(llmgw_requests_total{model="simmy", status="200"})') or 0) >= 6)
        assert prom.value("llmgw_controller_leading") == 1
        assert prom.value('llmgw_node_up{node="n1", state="ready"}') == 1
        assert prom.value(f'llmgw_replica_info{{replica="{replica["shard_id"]}", model="simmy", node="n1"}}') == 1
        assert prom.value('llmgw_node_memory_used_bytes{node="n1"}') > 0
        assert prom.value('llmgw_node_memory_total_bytes - llmgw_node_memory_available_bytes'
                          ' - llmgw_node_memory_used_bytes') == 0
        assert prom.value('count(llmgw_gpu_memory_total_bytes{node="n1"})') == 2  # the replayed two L40S
        saturation = prom.value('llmgw_pool_saturation{model="simmy"}')
        assert saturation is not None and 0 <= saturation < 1  # idle: nothing in flight, nothing queued
        assert {r["metric"]["band"] for r in prom.query('llmgw_admission_queue_depth{model="simmy"} == 0')} == {
            "high", "normal", "low"}
        assert prom.value(f'llmgw_endpoint_metrics_stale{{replica="{replica["shard_id"]}"}}') == 0
        assert prom.value("llmgw_mirror_disk_free_bytes") > 0
        assert prom.value('count(node_filesystem_avail_bytes{job="monitoring-host"})') >= 1
        # Every dashboard query runs (the API refuses a bad one), and draws something already, but for what
        # has not happened here (a 5xx, a refusal) and what this node's driver does not report. A rate needs
        # two samples of its series, and a series is first scraped after it first appears.
        wait_for("two samples of every series", WAIT, lambda: all(
            len(series["values"]) >= 2 for series in prom.query('{__name__=~"llmgw_.+|node_.+|up"}[1m]')))
        quiet = ('status=~"5.."', "admission_rejected", "client_", "sign_in_throttled", "gpu_utilization")
        empty = [expr for expr in dashboard_queries() if not prom.query(expr)]
        assert all(any(part in expr for part in quiet) for expr in empty), empty
        assert not prom.alerts("NodeNotReady")

        # A model removed: the gateway shows nothing of its replica or its pool any more, where it used to
        # show their last figures until the worker restarted. (A worker shows the models it routes to.)
        assert post(gw.url + "/v1/chat/completions", {**chat, "model": "extra"}, key)[0] == 200
        wait_for("the gateway reading extra's engine", WAIT,
                 lambda: f'llmgw_endpoint_metrics_stale{{replica="{extra["shard_id"]}"}} 0.0' in gw.metrics())
        assert 'llmgw_pool_saturation{model="extra"}' in gw.metrics()
        assert c.ctl("model", "remove", "extra").returncode == 0
        wait_for("extra's series gone from the gateway", WAIT,
                 lambda: f'replica="{extra["shard_id"]}"' not in gw.metrics()
                 and 'llmgw_pool_saturation{model="extra"}' not in gw.metrics())

        # The agent stops: the node is unreachable after a second (tests/cluster.py's FAST), NodeNotReady
        # goes pending, fires ten seconds later, and reaches Alertmanager with the node in its labels.
        agent.stop()
        wait_for("NodeNotReady pending", WAIT, lambda: [a["state"] for a in prom.alerts("NodeNotReady")] == ["pending"],
                 interval=0.2)
        (pending,) = prom.alerts("NodeNotReady")
        assert pending["labels"]["node"] == "n1" and pending["labels"]["severity"] == "warning"
        assert re.match(r"n1 is not ready: it is (unreachable|lost);", pending["annotations"]["summary"])
        wait_for("NodeNotReady firing", WAIT, lambda: [a["state"] for a in prom.alerts("NodeNotReady")] == ["firing"],
                 interval=0.2)
        wait_for("the alert at Alertmanager", WAIT,
                 lambda: [a["labels"]["node"] for a in manager.alerts() if a["labels"]["alertname"] == "NodeNotReady"]
                 == ["n1"])
        # The replica left with its node: the gateway shows nothing of it any more (not its last figures), and
        # the model's saturation, with no replica to measure, is absent rather than 0.
    finally:
        for stop in reversed(stops):
            stop()
