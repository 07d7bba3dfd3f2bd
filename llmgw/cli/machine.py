"""What `llmgw init` and `llmgw mirror init` do to a machine: its system user, directories, one configuration
file, systemd units, and who owns them. Each step looks first and says `kept …`, `done …` or `would …`.

A Layout says where everything goes; under `--root DIR` every path is inside DIR, which is how the tests
run both commands on a machine without systemd (nothing is then enabled or started by systemd, and no
user is made).
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
import time

import click

from llmgw import filemodes, settings
from llmgw.cli.bringup import ROOT, Steps

USER = "llmgw"
UNITS = os.path.join(ROOT, "deploy", "systemd")


class Layout:
    """Where a machine's llmgw files go: the usual places, or the same places inside ROOT."""

    def __init__(self, root: str | None):
        self.root = os.path.abspath(root) if root else ""

    def at(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/")) if self.root else path

    @property
    def config_dir(self) -> str:
        return self.at("/etc/llmgw")

    @property
    def keys_dir(self) -> str:
        return os.path.join(self.config_dir, "keys")

    @property
    def state_dir(self) -> str:
        return self.at("/var/lib/llmgw")

    @property
    def models_dir(self) -> str:
        return self.at("/srv/models")

    @property
    def agent_dir(self) -> str:
        return self.at("/var/lib/llmgw-agent")

    @property
    def weights_dir(self) -> str:
        return self.at("/var/lib/llmgw-weights")

    @property
    def units_dir(self) -> str:
        return self.at("/etc/systemd/system")


def refuse_unless_allowed(layout: Layout) -> None:
    """Writing /etc and /var/lib needs root; say so before doing anything rather than fail halfway."""
    if not layout.root and os.geteuid() != 0:
        raise click.ClickException("this writes /etc/llmgw, /var/lib/llmgw, /srv/models and systemd units: run it "
                                   "as root (sudo), or give --root DIR to write the whole tree under DIR instead")


def runs_systemd(layout: Layout) -> bool:
    """Whether systemd should enable and start the units: it runs here, we are root, and not under --root."""
    return not layout.root and os.geteuid() == 0 and os.path.isdir("/run/systemd/system")


def service_user(layout: Layout) -> str:
    """Who the roles run as: the system user when root makes the machine, else whoever runs this."""
    return USER if not layout.root and os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name


def ensure_user(steps: Steps, layout: Layout, home: str) -> None:
    """The system user the roles run as, made only by root outside --root."""
    if layout.root or os.geteuid() != 0:
        steps.skip(f"system user: {'under --root' if layout.root else 'not root'}, the roles run as "
                   f"{service_user(layout)}")
        return
    try:
        pwd.getpwnam(USER)
        steps.kept(f"system user {USER}")
        return
    except KeyError:
        pass
    steps.do(f"system user {USER} (no login, home {home})", lambda: subprocess.run(
        ["useradd", "--system", "--user-group", "--home-dir", home, "--no-create-home",
         "--shell", "/usr/sbin/nologin", USER], check=True, capture_output=True) and None, how="make")


def ensure_dirs(steps: Steps, dirs: list[str]) -> None:
    """Each of DIRS, made 0700 when missing (an existing one is left for the roles' start check to judge)."""
    for path in dirs:
        if os.path.isdir(path):
            steps.kept(f"directory {path}")
        else:
            steps.do(f"directory {path} (mode 0700)", lambda p=path: filemodes.make_private_dir(p))


def ensure_config(steps: Steps, path: str, wanted: dict, models: list[dict], force: dict | None = None) -> None:
    """The configuration file PATH (mode 0600: it may name a database with its password). What it already says
    is kept, so a rerun never undoes an operator's edit; settings in WANTED it lacks are added, FORCE's are
    set whatever it says (`--postgres`), and MODELS it lacks (by name) are appended."""
    have = settings.load(path) if os.path.exists(path) else None
    values = {**wanted, **(have.written if have else {}), **(force or {})}
    known = [m["name"] for m in have.models] if have else []
    all_models = (list(have.models) if have else []) + [m for m in models if m["name"] not in known]
    if have is not None and values == have.written and len(all_models) == len(have.models):
        steps.kept(f"configuration {path}")
        return
    added = sorted(set(values) - set(have.written)) if have else []
    changed = sorted(n for n in values if have and n in have.written and values[n] != have.written[n])
    note = ", ".join(filter(None, [added and f"added {', '.join(added)}", changed and f"set {', '.join(changed)}"]))
    if have is None:
        steps.do(f"configuration {path}", lambda: filemodes.write_private(
            path, "# Written by `llmgw init`; edit it freely: a rerun keeps what it says.\n"
            + settings.to_toml(values, models=all_models)) or note or None, how="write")
        return
    new_models = all_models[len(have.models):]

    def amend() -> str:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        backup = f"{path}.bak-{time.strftime('%Y%m%d-%H%M%S')}"
        filemodes.write_private(backup, text)
        filemodes.write_private(path, amended(text, {n: values[n] for n in added + changed}, new_models))
        return f"{note or 'added models'}; what it said is kept, comments and all, and a copy is in {backup}"

    steps.do(f"configuration {path}", amend, how="amend")


def amended(text: str, values: dict, models: list[dict]) -> str:
    """TEXT, a configuration file as an operator may have written it, with VALUES (dotted settings) set and
    MODELS appended, and nothing else changed: a setting it has is rewritten on its own line, one it lacks is
    added under its table's header (or in a new table at the end), so the operator's comments and order stay."""
    lines = text.splitlines()
    header = re.compile(r"^\s*\[\s*([A-Za-z0-9_-]+)\s*\]\s*(#.*)?$")
    any_header = re.compile(r"^\s*\[")
    tables: dict[str, int] = {}
    for i, line in enumerate(lines):
        found = header.match(line)
        if found:
            tables.setdefault(found.group(1), i)
    fresh: dict[str, list[str]] = {}
    for name, value in values.items():
        table, key = name.split(".", 1)
        line = f"{key} = {settings.toml_value(value)}"
        start = tables.get(table)
        if start is None:
            fresh.setdefault(table, []).append(line)
            continue
        end = next((j for j in range(start + 1, len(lines)) if any_header.match(lines[j])), len(lines))
        own = re.compile(rf"^\s*{re.escape(key)}\s*=")
        at = next((j for j in range(start + 1, end) if own.match(lines[j])), None)
        if at is not None:
            lines[at] = line
        else:
            lines.insert(start + 1, line)
            tables = {t: (k + 1 if k > start else k) for t, k in tables.items()}
    out = "\n".join(lines).rstrip("\n") + "\n"
    for table, entries in fresh.items():
        out += f"\n[{table}]\n" + "\n".join(entries) + "\n"
    if models:
        out += "\n" + settings.to_toml({}, models=models)
    return out


def unit_text(role: str, layout: Layout, config: str, user: str, extra: str = "", python: str = sys.executable,
              scripts: str = ROOT) -> str:
    """deploy/systemd/llmgw-ROLE.service for this machine: CONFIG, this installation's Python and scripts (or
    PYTHON and SCRIPTS, another machine's, for `llmgw node add`), the layout's directories and USER. EXTRA
    lines go at the end of [Service]."""
    with open(os.path.join(UNITS, f"llmgw-{role}.service"), encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"/etc/llmgw/\w+\.toml", config, text)
    text = text.replace("/opt/llmgw/.venv/bin/python", python).replace("/opt/llmgw/", scripts + "/")
    text = re.sub(r"/var/lib/llmgw(?![\w-])", layout.state_dir, text).replace("/srv/models", layout.models_dir)
    text = re.sub(r"^(User|Group)=llmgw$", lambda m: f"{m.group(1)}={user}", text, flags=re.M)
    if extra:
        text = text.replace("\n[Install]", f"{extra}\n[Install]")
    return text


def ensure_units(steps: Steps, layout: Layout, units: dict[str, str]) -> None:
    """Each systemd unit (name -> text) in the layout's units directory, rewritten only when it differs."""
    for name, text in units.items():
        path = os.path.join(layout.units_dir, f"{name}.service")
        if os.path.exists(path) and open(path, encoding="utf-8").read() == text:
            steps.kept(f"unit {path}")
            continue

        def write(path=path, text=text) -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)

        steps.do(f"unit {path}", write, how="write")


def ensure_owned(steps: Steps, layout: Layout, paths: list[str]) -> None:
    """PATHS (and what is in them) owned by the system user, so the roles can read their secrets: only when
    root made them for that user."""
    if layout.root or os.geteuid() != 0:
        return
    try:
        owner = pwd.getpwnam(USER)
    except KeyError:
        steps.do(f"files owned by {USER}", None, how="give")  # planning: the user does not exist yet
        return
    found = [os.path.join(top, name) for path in paths if os.path.exists(path)
             for top, dirs, files in os.walk(path) for name in dirs + files] + [p for p in paths if os.path.exists(p)]
    wrong = [p for p in found if os.lstat(p).st_uid != owner.pw_uid]
    if not wrong:
        steps.kept(f"files owned by {USER}")
        return
    steps.do(f"{len(wrong)} files owned by {USER}", lambda: [os.lchown(p, owner.pw_uid, owner.pw_gid) for p in wrong]
             and None, how="give")


def ensure_running(steps: Steps, units: list[str]) -> None:
    """The units enabled and started by systemd."""
    active = subprocess.run(["systemctl", "is-active", "--quiet", *units]).returncode == 0
    enabled = subprocess.run(["systemctl", "is-enabled", "--quiet", *units]).returncode == 0
    if active and enabled:
        steps.kept(f"{', '.join(units)} enabled and running")
        return

    def start() -> None:
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "enable", "--now", *units], check=True)

    steps.do(f"{', '.join(units)} enabled and started", start, how="enable and start")
