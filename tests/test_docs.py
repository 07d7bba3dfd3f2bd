"""The documents and deployment files say what the code does."""

import os
import re

from click.testing import CliRunner

from llmgw import settings
from llmgw.cli.main import main as cli
from llmgw.gateway.metrics import GatewayMetrics
from tests.conftest import ROOT


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def exported_names():
    """Every series name the gateway exports; counters gain _total."""
    return {value._name + ("_total" if type(value).__name__ == "Counter" else "")
            for value in vars(GatewayMetrics()).values()}


def test_readme_opens_with_the_two_commands():
    first_screen = "\n".join(read("README.md").splitlines()[:12])
    assert "make run" in first_screen and "make test" in first_screen


def test_ci_runs_what_the_readme_says():
    assert "make test" in read(".ci/run")


def test_every_metric_is_documented():
    doc = read("docs/operations.md")
    for name in exported_names():
        assert f"`{name}`" in doc, f"{name} is not in docs/operations.md"


def test_alert_rules_use_only_series_the_gateway_emits():
    rules = read("deploy/prometheus/llmgw-gateway-rules.yml")
    used = set(re.findall(r"\b(llmgw_[a-z_]+?)(?:_bucket|_sum|_count)?\b", rules))
    emitted = exported_names()
    assert used and used <= emitted, used - emitted


def test_the_mirrors_metrics_are_documented_and_alerted_on_truly(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from llmgw.mirror.fetch import Manager
    from llmgw.mirror.server import MirrorCollector
    from llmgw.mirror.store import MirrorDir

    registry = CollectorRegistry()
    registry.register(MirrorCollector(Manager(MirrorDir(str(tmp_path)))))
    text = generate_latest(registry).decode()
    emitted = set(re.findall(r"^(llmgw_[a-z_]+?)(?:_total)? ", text, re.M))
    doc = read("docs/operations.md")
    for name in emitted:
        exported = name + "_total" if f"{name}_total " in text else name
        assert f"`{exported}`" in doc, f"{exported} is not in docs/operations.md"
    used = set(re.findall(r"\b(llmgw_[a-z_]+)\b", read("deploy/prometheus/llmgw-mirror-rules.yml")))
    assert used and used <= emitted, used - emitted


def test_every_setting_is_in_the_reference():
    doc = read("docs/reference.md")
    for s in settings.SETTINGS:
        assert f"`{s.name.split('.', 1)[1]}`" in doc


def test_the_systemd_unit_runs_the_gateway_with_time_to_drain():
    unit = read("deploy/systemd/llmgw-gateway.service")
    assert "ExecStart=/opt/llmgw/.venv/bin/python /opt/llmgw/gateway.py" in unit
    stop = int(re.search(r"TimeoutStopSec=(\d+)", unit).group(1))
    grace = next(s.default for s in settings.SETTINGS if s.name == "gateway.graceful_timeout")
    assert stop > grace  # systemd must not kill a gateway still letting streams finish


def test_commands_have_help():
    runner = CliRunner()
    for args in (["--help"], ["keys", "--help"], ["keys", "create", "--help"], ["sim", "--help"], ["up", "--help"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0 and "Usage:" in result.output, args


def test_every_fleet_metric_is_documented():
    from llmgw.control.fleet import Fleet
    from llmgw.control.fleetmetrics import FleetCollector

    doc = read("docs/operations.md")
    for family in FleetCollector(Fleet(15, 60)).collect():
        assert f"`{family.name}`" in doc, family.name


def test_the_agent_unit_lets_engines_outlive_the_agent():
    unit = read("deploy/systemd/llmgw-agent.service")
    assert "KillMode=process" in unit and "LimitMEMLOCK=infinity" in unit
    assert "ExecStart=/opt/llmgw/.venv/bin/python /opt/llmgw/agent.py" in unit


def test_every_module_is_in_the_architecture_page():
    import pathlib

    doc = read("docs/architecture.md")
    for path in sorted(pathlib.Path(ROOT, "llmgw").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") or path.parent.name == "engines":
            continue
        name = path.relative_to(ROOT).as_posix()
        assert f"`{name}`" in doc, f"{name} is not described in docs/architecture.md"
    assert "`llmgw/engines/`" in doc
