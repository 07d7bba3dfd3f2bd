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


def test_the_house_table_states_the_rules_and_the_arrows_there_are():
    # Lines and modules move with every change (bench/house.py counts them); the rules and the arrows between
    # packages are the design, and must stay true.
    from bench.house import measure
    from tests.test_house import MAY_IMPORT

    rows = re.findall(r"^\| `(\w+)` \| [^|]* \| ([^|]*) \| ([^|]*) \|$", read("docs/architecture.md"), re.M)
    arrows = {package: ", ".join(sorted(room["imports"])) or "-" for package, room in measure().items()}
    assert {p: today.strip() for p, _, today in rows} == arrows
    for package, rule, _ in rows:
        # "top level but `store`" names a top-level module left out, not a package.
        named = set(re.findall(r"`(\w+)`", re.sub(r"top level but `\w+`", "top level", rule)))
        may = MAY_IMPORT[package] - {package, "top"}
        if rule.startswith("anything but"):
            named = set(MAY_IMPORT) - {"top", package} - named
        assert named == may, (package, rule, sorted(may))


# Dotted names that look like modules but are not: files, and the Flask app's name.
NOT_MODULES = re.compile(r"\.(toml|db|yml|json|service|py|md)\b|^llmgw\.db|^llmgw\.admin$|__file__")


def _module_names() -> tuple[dict[str, str], set[str]]:
    """Every llmgw module (dotted -> path) and every logger name the code makes."""
    from bench.house import modules

    found = modules()
    loggers = set()
    for path in [*found.values(), *(os.path.join(ROOT, role) for role in ROLE_FILES)]:
        with open(path, encoding="utf-8") as f:
            loggers |= set(re.findall(r'getLogger\("([a-z_.]+)"\)', f.read()))
    return found, loggers


ROLE_FILES = ("gateway.py", "controller.py", "agent.py", "mirror.py", "doctor.py")


def _defines(path: str, name: str) -> bool:
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def test_every_module_path_and_dotted_name_in_the_docs_and_the_code_exists():
    """A moved module leaves its old path in prose: docs/, the README, and every docstring and comment."""
    import pathlib

    found, loggers = _module_names()
    texts = [*pathlib.Path(ROOT, "docs").glob("*.md"), pathlib.Path(ROOT, "README.md"),
             *pathlib.Path(ROOT, "llmgw").rglob("*.py"), *pathlib.Path(ROOT, "bench").glob("*.py"),
             *(pathlib.Path(ROOT, role) for role in ROLE_FILES)]
    stale = []
    for path in texts:
        where = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for named in re.findall(r"(?<![\w/.-])(llmgw/[\w/]+\.py)\b", line):
                if not os.path.exists(os.path.join(ROOT, named)):
                    stale.append(f"{where}:{number}: {named}")
            for named in re.findall(r"(?<![\w/.])llmgw(?:\.[a-z_]\w*)+", line):
                if NOT_MODULES.search(named) or named in found or named in loggers:
                    continue
                module, _, name = named.rpartition(".")
                if module in found and _defines(found[module], name):
                    continue  # a class, function or constant of a module that exists
                stale.append(f"{where}:{number}: {named}")
    assert stale == []
