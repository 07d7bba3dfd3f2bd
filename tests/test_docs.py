"""The documents and deployment files say what the code does."""

import os
import re

from click.testing import CliRunner

from llmgw import settings
from llmgw.cli.main import main as cli
from tests.conftest import ROOT
from tests.promstack import emitted


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_readme_opens_with_the_two_commands():
    first_screen = "\n".join(read("README.md").splitlines()[:12])
    assert "make run" in first_screen and "make test" in first_screen


def test_ci_runs_what_the_readme_says():
    assert "make test" in read(".ci/run")


def test_every_metric_a_role_emits_is_documented(tmp_path):
    doc = read("docs/operations.md")
    series = emitted(tmp_path)
    histograms = {name.removesuffix("_bucket") for name in series if name.endswith("_bucket")}
    for name in series:
        # A histogram is documented by its own name, not its three series.
        documented = next((h for h in histograms if name in (h + "_bucket", h + "_sum", h + "_count")), name)
        if documented.startswith("llmgw_"):
            assert f"`{documented}`" in doc, f"{documented} is not in docs/operations.md"


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


def test_the_house_table_names_the_arrows_between_packages_there_are():
    # Lines and modules move with every change; which package imports which is the design, and must stay true.
    from bench.house import measure

    table = dict(re.findall(r"^\| `(\w+)` \| \d+ \| \d+ \| ([^|]*) \|$", read("docs/architecture.md"), re.M))
    arrows = {package: ", ".join(sorted(room["imports"])) or "-" for package, room in measure().items()}
    assert {p: d.strip() for p, d in table.items()} == arrows
