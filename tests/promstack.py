"""Debian's Prometheus, Alertmanager and node_exporter as real processes, and the series llmgw emits.

Each server starts on free loopback ports with its data in the test's directory, is polled until
it answers, and is stopped at the end. `make test` installs the packages (as root); without them a
test fails, saying what to install, rather than skipping. `emitted` gathers every series the roles
export, with its labels, from the code's own metric objects and real processes: what the
documentation, the alert rules and the dashboard may name.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.parse
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.procs import free_port, http_status, wait_for
from tests.conftest import stop_process

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
AMTOOL = "/usr/bin/amtool"
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
# Labels Prometheus gives every series it scrapes.
SCRAPED = {"job", "instance"}
PACKAGES = {PROMETHEUS: "prometheus", PROMTOOL: "prometheus", ALERTMANAGER: "prometheus-alertmanager",
            AMTOOL: "prometheus-alertmanager", NODE_EXPORTER: "prometheus-node-exporter"}


def need(path: str) -> str:
    assert os.path.exists(path), f"{path} is missing: apt-get install {PACKAGES[path]} (make test installs it as root)"
    return path


def read(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def get_json(url: str, timeout: float = 10):
    return json.loads(read(url, timeout))


class Server:
    """One of the three, started by `argv(port)` and up once `ready_path` answers 200."""

    binary = ""
    ready_path = ""

    def __init__(self, tmp, name: str):
        self.log_path = tmp / f"{name}.log"
        for attempt in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([need(self.binary), *self.argv()], stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_for(f"{name} to answer", 60, lambda: http_status(self.url + self.ready_path) == 200,
                         alive=lambda: self.proc.poll() is None)
                return
            except RuntimeError:
                # A free port is free when asked; on a busy machine another process may take it first.
                if attempt == 2 or "address already in use" not in self.log():
                    raise RuntimeError(f"{name} did not start:\n{self.log()}") from None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def state(self) -> str:
        """Its process's state letter: T once SIGSTOP has stopped it."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def stop(self) -> None:
        stop_process(self.proc)


class NodeExporter(Server):
    """node_exporter with only its filesystem collector: the disks, which is what the rules watch."""

    binary = NODE_EXPORTER
    ready_path = "/metrics"

    def __init__(self, tmp):
        super().__init__(tmp, "node-exporter")

    def argv(self):
        return [f"--web.listen-address=127.0.0.1:{self.port}", "--collector.disable-defaults",
                "--collector.filesystem"]


class Alertmanager(Server):
    binary = ALERTMANAGER
    ready_path = "/-/ready"

    def __init__(self, tmp, config: str):
        self.config = config
        self.data = tmp / "alertmanager"
        super().__init__(tmp, "alertmanager")

    def argv(self):
        # An empty cluster address: no gossip port, which a lone Alertmanager does not need.
        return [f"--config.file={self.config}", f"--storage.path={self.data}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="]

    def alerts(self) -> list[dict]:
        return get_json(self.url + "/api/v2/alerts")

    def post(self, alerts: list[dict]) -> None:
        req = urllib.request.Request(self.url + "/api/v2/alerts", data=json.dumps(alerts).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200


class Prometheus(Server):
    """Prometheus with CONFIG; without one, scraping every second what `scrape` names.

    Without a configuration it can start before what it scrapes, whose ports are known only once they run,
    so that a port taken meanwhile by another process costs a retry here rather than a role configured with
    a dead address: the targets are in files it watches (file_sd), written by `scrape`."""

    binary = PROMETHEUS
    ready_path = "/-/ready"

    def __init__(self, tmp, config: str | None = None):
        self.tmp = tmp
        if config is None:
            config = str(tmp / "prometheus.yml")
            with open(config, "w") as f:
                f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n"
                        "  - job_name: test-targets\n    file_sd_configs: [{files: ['targets-*.json'], "
                        "refresh_interval: 1s}]\n")
        self.config = config
        self.data = tmp / "prometheus"
        super().__init__(tmp, "prometheus")

    def scrape(self, job: str, target: str) -> None:
        """Scrape TARGET (HOST:PORT) as JOB, a job name of the test's own (without a configuration given)."""
        (self.tmp / f"targets-{job}.json").write_text(json.dumps([{"targets": [target], "labels": {"job": job}}]))

    def argv(self):
        return [f"--config.file={self.config}", f"--storage.tsdb.path={self.data}",
                f"--web.listen-address=127.0.0.1:{self.port}"]

    def api(self, path: str, **params):
        """The `data` of one query API answer; fails the test on an error, with Prometheus' own words."""
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            answer = get_json(url)
        except urllib.error.HTTPError as e:
            with e:
                answer = json.loads(e.read())
        assert answer["status"] == "success", (params, answer)
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        """EXPR now: its series, each {"metric": labels, "value": [time, "text"]}, or "values" for a range."""
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        """EXPR's one value now, or None when it has none."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def alerts(self, name: str) -> list[dict]:
        """The alerts NAME has now, pending or firing, with their labels and `state`."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]


def parsed(text: str) -> dict[str, set[str]]:
    """Series name -> label names, from exposition TEXT; a family with no samples yet is named with none."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        series.setdefault(family.name + ("_total" if family.type == "counter" else ""), set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def emitted(tmp) -> dict[str, set[str]]:
    """Every series the roles emit -> its labels (less SCRAPED): the gateway's metric objects, the mirror's
    collector, a real controller's exposition and a real node_exporter's filesystem series."""
    from prometheus_client.metrics import MetricWrapperBase

    from llmgw.control.fleet import Fleet
    from llmgw.control.fleetmetrics import FleetCollector
    from llmgw.gateway.metrics import GatewayMetrics
    from llmgw.mirror.fetch import Manager
    from llmgw.mirror.server import MirrorCollector
    from llmgw.mirror.store import MirrorDir
    from tests.cluster import Controller

    series = {"up": set()}
    for held in vars(GatewayMetrics()).values():
        metric = getattr(held, "metric", getattr(held, "target", held))  # a tally's own library object
        if not isinstance(metric, MetricWrapperBase):
            continue  # the list of what it folds
        labels, kind = set(metric._labelnames), type(metric).__name__
        if kind == "Histogram":
            series.update({metric._name + "_bucket": labels | {"le"}, metric._name + "_sum": labels,
                           metric._name + "_count": labels})
        else:
            series[metric._name + ("_total" if kind == "Counter" else "")] = labels
    registry = CollectorRegistry()
    (tmp / "mirror").mkdir()
    registry.register(MirrorCollector(Manager(MirrorDir(str(tmp / "mirror")))))
    series.update(parsed(generate_latest(registry).decode()))
    # A real controller names every family it serves; the fleet's labels are the collector's own, since a
    # controller with no nodes has no fleet samples to show them.
    controller = Controller(tmp)
    try:
        series.update(parsed(controller.metrics()))
    finally:
        controller.stop()
    for family in FleetCollector(Fleet(15, 60)).collect():
        series[family.name + ("_total" if family.type == "counter" else "")] = set(family._labelnames)
    exporter = NodeExporter(tmp)
    try:
        series.update((name, labels) for name, labels in parsed(read(exporter.url + "/metrics")).items()
                      if name.startswith("node_filesystem_"))
    finally:
        exporter.stop()
    return series
