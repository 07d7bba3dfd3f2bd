"""`llmgw node add [user@]host ...`: make machines reached over SSH into nodes of this controller.

For each host, in turn: look at it (Python 3.11+, venv, architecture, disk), copy a wheelhouse of this
installation and the role scripts, install them in a virtual environment there with no package index,
issue the node's key through the admin API and copy it 0600 (a key it holds is kept), write the agent's
configuration (with this machine's engine catalogue, `[[engines]]`), run the doctor there (a failure
stops this host unless --ignore-checks), start the agent (a systemd unit when the SSH user is root on a
machine running systemd, otherwise detached, and said so), and wait until the controller has its
registration with the engines it probed (and, with --wait-engine, until it installed those engines:
vLLM's gigabytes arrive when the node joins, not at its first replica). Hosts run side by side; each ends
in one checklist line, and a failure names its step and what to do without stopping the others. A rerun
installs what changed and restarts the agent, so it is how a node is upgraded too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import ipaddress
import json
import os
import shlex
import tarfile
import tempfile
import threading
import time
import tomllib

import click

import llmgw
from llmgw import addresses, settings
from llmgw.apiclient import ApiClient, ApiError
from llmgw.cli import engineinstall, machine, wheelhouse
from llmgw.cli.ssh import SshError, Target
from llmgw.cli.tables import printable

# Room the virtual environment needs beyond the wheels themselves (they unpack to about three times their size).
INSTALL_ROOM = 2 << 30

# Run on the host with its own python3: what it is, as JSON. Nothing is changed there.
PROBE = r'''
import json, os, platform, shutil, socket, sys
def free(path):
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free
try:
    import ensurepip, venv
    has_venv = True
except ImportError:
    has_venv = False
home = os.path.expanduser("~")
default = "/opt/llmgw" if os.getuid() == 0 else home + "/llmgw"
prefix = os.path.abspath(os.path.expanduser(sys.argv[1])) if sys.argv[1] else default
def os_release():
    try:
        with open("/etc/os-release") as f:
            pairs = (line.rstrip("\n").split("=", 1) for line in f if "=" in line)
            return {k: v.strip('"') for k, v in pairs if k in ("ID", "ID_LIKE", "PRETTY_NAME")}
    except OSError:
        return {}
print(json.dumps({"python": list(sys.version_info[:2]), "executable": sys.executable, "machine": platform.machine(),
                  "os": os_release(),
                  "has_venv": has_venv, "uid": os.getuid(), "hostname": socket.gethostname().split(".")[0],
                  "systemd": os.path.isdir("/run/systemd/system"), "prefix": prefix, "free": free(prefix),
                  "ssh_from": (os.environ.get("SSH_CONNECTION") or "").split(" ")[0]}))
'''


class Failed(Exception):
    """One host's step failed; the message says what happened and what to do."""


@dataclasses.dataclass
class Options:
    admin: ApiClient
    agent_listen: str  # controller.agent_listen, for the address a host dials when --controller is not given
    controllers: tuple[str, ...]
    name: str | None
    prefix: str
    python: str
    labels: dict
    fabrics: list[dict]  # the agent's [[fabrics]]
    ignore_checks: bool
    new_key: bool
    wait: bool
    wait_timeout: float
    engines: list[dict]  # the control plane's engine catalogue, `[[engines]]`, copied to each node
    mirror_url: str  # where a node fetches the catalogue's mirror paths
    wait_engines: tuple[str, ...]  # engines each node installs at once, waited for
    engine_timeout: float
    accept_new: bool
    port: int | None
    identity: str | None
    known_hosts: str | None


class Batch:
    """What the hosts of one run share across their threads: the person's terminal, and node names."""

    def __init__(self):
        self.lock = threading.Lock()
        self.names: dict[str, str] = {}

    def say(self, host: str, text: str) -> None:
        """One line about HOST; TEXT may hold what the host or its node said, shown inert (tables.printable),
        line by line."""
        with self.lock:
            click.echo(f"{host}: " + "\n".join(printable(line) for line in text.split("\n")), err=True)

    def claim(self, host: str, node: str) -> None:
        """NODE is HOST's in this run; Failed when another host of the run has it (the second key issued
        would revoke the first)."""
        with self.lock:
            other = self.names.setdefault(node, host)
        if other != host:
            raise Failed(f"{other} is also called {node} in this run: add each with its own --name")


def run(options: Options, hosts: tuple[str, ...]) -> bool:
    """Add every host in HOSTS; True when all of them were added."""
    batch = Batch()
    hosts = tuple(dict.fromkeys(hosts))  # one host named twice is done once
    try:
        options.admin.call("GET", "/api/v1/status")
    except ApiError as e:
        raise click.ClickException(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="llmgw-wheelhouse-") as house:
        started = time.monotonic()
        try:
            wheels = wheelhouse.build(house, wheelhouse.installed_extras())
        except wheelhouse.WheelhouseError as e:
            raise click.ClickException(str(e)) from None
        size = sum(os.path.getsize(w) for w in wheels)
        click.echo(f"built {len(wheels)} wheels of this installation ({size / 2**20:.0f} MiB, "
                   f"{time.monotonic() - started:.0f} s)", err=True)
        bundle = _bundle(wheels)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(hosts), 8)) as pool:
            results = list(pool.map(lambda h: _one(options, h, bundle, size, batch), hosts))
    click.echo("", err=True)
    for host, (ok, line) in zip(hosts, results):
        click.echo(f"{'✓' if ok else '✗'} {host}: " + "\n".join(printable(part) for part in line.split("\n")),
                   err=True)
    failed = [host for host, (ok, _) in zip(hosts, results) if not ok]
    if len(hosts) > 1:  # the line to read first when a rack was added at once
        click.echo(f"{len(hosts) - len(failed)} of {len(hosts)} hosts added"
                   + (f"; failed: {', '.join(failed)} (each line above says why; run node add again for them)"
                      if failed else ""), err=True)
    return not failed


def _bundle(wheels: list[str]) -> bytes:
    """A tar of the wheels and the role scripts the node runs (agent.py, doctor.py, which live beside the
    package, not in it)."""
    source = os.path.dirname(os.path.dirname(os.path.abspath(llmgw.__file__)))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for script in ("agent.py", "doctor.py"):
            path = os.path.join(source, script)
            if not os.path.exists(path):
                raise click.ClickException(f"{path} is missing: node add copies the role scripts from the source "
                                           "tree llmgw runs from; run it from a checkout of llmgw")
            tar.add(path, arcname=script)
        for w in wheels:
            tar.add(w, arcname=f"wheels/{os.path.basename(w)}")
    return buf.getvalue()


def _one(options: Options, destination: str, bundle: bytes, size: int, batch: Batch) -> tuple[bool, str]:
    target = Target(destination, options.port, options.identity, options.known_hosts, options.accept_new)
    step = "checking the host"
    try:
        host = _probe(target, options, size)
        node = options.name or host["hostname"]
        batch.claim(destination, node)
        keep = _holds_key(target, options, host, node)
        batch.say(destination, f"Python {'.'.join(map(str, host['python']))} on {host['machine']}, "
                                 f"{host['free'] / 2**30:.0f} GiB free; installing into {host['prefix']} as node {node}")
        step = "installing llmgw"
        _install(target, host, bundle)
        batch.say(destination, "installed llmgw and its dependencies (no package index used)")
        step = "issuing the node's key"
        batch.say(destination, "kept the node's key it holds (--new-key issues another)" if keep
                  else _issue_key(target, options, host, node))
        step = "writing the agent's configuration"
        _configure(target, options, host)
        step = "running the doctor"
        batch.say(destination, _doctor(target, options, host))
        step = "starting the agent"
        began = time.time()
        how, why = _start(target, host)
        batch.say(destination, f"agent started {how}{why}")
        if not options.wait:
            return True, f"node {node} installed and its agent started {how}; not waiting (--no-wait)"
        step = "waiting for it to register"
        engines = _wait(target, options, host, node, began)
        for engine in options.wait_engines:
            step = f"installing {engine}"
            version = engineinstall.install(options.admin, node, engine, options.engine_timeout,
                                            lambda line: batch.say(destination, line))
            batch.say(destination, f"installed {engine} {version}")
            engines += f", {engine} {version} (installed now)"
        return True, f"node {node} is ready, engines: {engines}; its agent runs {how}"
    except (Failed, SshError, engineinstall.InstallFailed, ApiError) as e:
        return False, f"failed {step}: {e}"
    except Exception as e:  # one host's surprise must not end the others' installs midway
        return False, f"failed {step}: {type(e).__name__}: {e} (unexpected: please report it with this line)"


def _probe(target: Target, options: Options, size: int, install: bool = True) -> dict:
    missing = f"there is no {options.python} on its PATH: install Python 3.11 or later there, or give --python"
    _, out = target.run(f"command -v {shlex.quote(options.python)} >/dev/null 2>&1 || {{ echo "
                        f"{shlex.quote(missing)} >&2; exit 3; }}; "
                        f"{shlex.quote(options.python)} - {shlex.quote(options.prefix)} <<'EOF'\n{PROBE}\nEOF",
                        what="looking at the host", timeout=60)
    try:
        host = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise Failed(f"its {options.python} did not say what it is; it printed: {out.strip()[-300:]!r}") from None
    version = tuple(host["python"])
    here = tuple(int(x) for x in wheelhouse.python_tag().split("."))
    if version < (3, 11):
        raise Failed(f"its {options.python} is Python {version[0]}.{version[1]}; llmgw needs 3.11 or later: install "
                     f"python{here[0]}.{here[1]} and python{here[0]}.{here[1]}-venv there and give "
                     f"--python python{here[0]}.{here[1]}")
    if not host["has_venv"]:
        command = install_command(host.get("os") or {}, venv_packages(host.get("os") or {}, version))
        if not install:
            raise Failed(f"`{command}` ran there, and its {options.python} still cannot make virtual environments")
        if host["uid"] != 0 or command is None:
            hint = command or "the package that gives Python its venv module"
            raise Failed(f"its {options.python} cannot make virtual environments: install it there ({hint}), or "
                         "run node add as root there, which installs it")
        target.run(command, what="installing Python's venv module", timeout=APT_LOCK_WAIT + 600)
        return _probe(target, options, size, install=False)  # what it has now
    if version != here or host["machine"] != os.uname().machine:
        raise Failed(f"it has Python {version[0]}.{version[1]} on {host['machine']}, and the wheels of this "
                     f"installation are for Python {here[0]}.{here[1]} on {os.uname().machine}: install "
                     f"python{here[0]}.{here[1]} there and give --python python{here[0]}.{here[1]}, or run node add "
                     "from a machine like the host")
    if host["free"] < size + INSTALL_ROOM:
        raise Failed(f"only {host['free'] / 2**30:.1f} GiB is free for {host['prefix']}; llmgw needs about "
                     f"{(size + INSTALL_ROOM) / 2**30:.0f} GiB: free some space or give --dir on a larger disk")
    return host


# A fresh machine's apt is often busy (cloud-init, unattended-upgrades) for minutes after it boots, and
# its lists' lock is not covered by DPkg::Lock::Timeout: both are waited for this long (lesson 50).
APT_LOCK_WAIT = 600


def family(os_release: dict) -> str | None:
    """The package family of a machine, from /etc/os-release's ID and ID_LIKE: by family, not by name, so a
    derivative is not refused for a name nobody listed (lesson 49)."""
    names = {os_release.get("ID", ""), *os_release.get("ID_LIKE", "").split()}
    for kind, members in (("apt", {"debian", "ubuntu"}), ("dnf", {"fedora", "rhel", "centos"}),
                          ("zypper", {"suse", "opensuse", "sles"})):
        if names & members:
            return kind
    return None


def venv_packages(os_release: dict, version: tuple) -> list[str]:
    """The packages that give Python VERSION its venv module in this machine's family."""
    kind, short = family(os_release), f"{version[0]}.{version[1]}"
    return {"apt": [f"python{short}-venv"], "dnf": [f"python{version[0]}{version[1]}" if version >= (3, 11)
                                                    else "python3"],
            "zypper": [f"python{version[0]}{version[1]}"]}.get(kind or "", [])


def install_command(os_release: dict, packages: list[str]) -> str | None:
    """A shell command that installs PACKAGES with the machine's own package manager, waiting for a held apt
    lock; None for a family llmgw does not know (then the operator installs them)."""
    kind = family(os_release)
    if kind is None or not packages:
        return None
    names = " ".join(shlex.quote(p) for p in packages)
    if kind == "apt":
        waits = " ".join(f"/var/lib/{p}" for p in ("apt/lists/lock", "dpkg/lock-frontend", "dpkg/lock"))
        return (f"i=0; while command -v fuser >/dev/null && fuser {waits} >/dev/null 2>&1 && [ $i -lt {APT_LOCK_WAIT} ]; "
                "do sleep 5; i=$((i+5)); done; export DEBIAN_FRONTEND=noninteractive; "
                f"apt-get -o DPkg::Lock::Timeout={APT_LOCK_WAIT} update -qq && "
                f"apt-get -o DPkg::Lock::Timeout={APT_LOCK_WAIT} install -y -qq {names}")
    if kind == "dnf":
        return f"(command -v dnf >/dev/null && dnf install -y -q {names}) || yum install -y -q {names}"
    return f"zypper --non-interactive install {names}"


def _install(target: Target, host: dict, bundle: bytes) -> None:
    prefix = shlex.quote(host["prefix"])
    pip = f"{prefix}/.venv/bin/pip install --quiet --disable-pip-version-check --no-index"
    # Every wheel named, so a version here replaces another one there; llmgw's own forced, since an
    # upgrade of it keeps its version number.
    target.run(f"set -e; umask 022; mkdir -p {prefix}; cd {prefix}; rm -rf wheels; tar xf -; "
               f"test -x .venv/bin/python || {shlex.quote(host['executable'])} -m venv .venv; "
               f"{pip} --find-links wheels wheels/*.whl; "
               f"{pip} --no-deps --force-reinstall wheels/llmgw-*.whl",
               stdin=bundle, what="installing llmgw", timeout=900)


def _holds_key(target: Target, options: Options, host: dict, node: str) -> bool:
    """Whether the host holds NODE's key, which is kept (without --new-key): a rerun that stops at the
    doctor then leaves the running agent's key working. Failed, before anything is copied, when the
    controller knows another NODE whose key this host lacks."""
    if options.new_key:
        return False
    _, held = target.run(f"cat {shlex.quote(host['prefix'] + '/node.key')} 2>/dev/null", check=False,
                         what="reading the node's key")
    try:
        if tomllib.loads(held).get("node_id") == node:
            return True
    except tomllib.TOMLDecodeError:
        pass
    try:
        known = {n["node_id"]: n for n in options.admin.call("GET", "/api/v1/nodes")["nodes"]}.get(node)
    except ApiError as e:
        raise Failed(str(e)) from None
    if known:
        # Issuing would revoke that node's key: two machines with one host name (cloud images' "ubuntu")
        # must not knock each other off the controller.
        raise Failed(f"the controller already has a node called {node} ({known['state']}, address "
                     f"{known['facts'].get('address') or 'unknown'}) and this host does not hold its key: give "
                     f"--name NAME for this host, or --new-key if it is that node (its old key stops working)")
    return False


def _issue_key(target: Target, options: Options, host: dict, node: str) -> str:
    """Issue NODE's key and write it there, 0600; what was done, in words."""
    try:
        key_file = options.admin.call("POST", "/api/v1/node-keys", {"node_id": node})["key_file"]
    except ApiError as e:
        raise Failed(str(e)) from None
    path = shlex.quote(host["prefix"] + "/node.key")
    target.run(f"set -e; umask 077; cat > {path}.new; chmod 600 {path}.new; mv {path}.new {path}",
               stdin=key_file.encode(), what="writing the node's key")
    return "issued the node's key (any earlier one no longer works)"


def _controllers(options: Options, host: dict) -> list[str]:
    """Where the host dials the controller: --controller, else controller.agent_listen's port at the
    address this machine has as the host sees it (its SSH connection's source)."""
    if options.controllers:
        return list(options.controllers)
    listen_host, port = addresses.parse(options.agent_listen, "controller.agent_listen")
    source = host["ssh_from"]
    if listen_host in addresses.WILDCARDS and source:
        return [addresses.join(source, port)]
    try:
        loopback = ipaddress.ip_address(listen_host).is_loopback
    except ValueError:
        loopback = listen_host == "localhost"
    if loopback and not (source and ipaddress.ip_address(source).is_loopback):
        raise Failed(f"controller.agent_listen is {options.agent_listen}, which no other machine reaches: set it to "
                     f":{port} (and restart the controller), or give --controller HOST:PORT as the host reaches it")
    return [addresses.join(listen_host or source, port)]


def _configure(target: Target, options: Options, host: dict) -> None:
    prefix = host["prefix"]
    values = {"agent.controllers": _controllers(options, host), "agent.key_file": f"{prefix}/node.key",
              "agent.weights_dir": f"{prefix}/weights", "agent.work_dir": f"{prefix}/work",
              "agent.engines_dir": f"{prefix}/engines",
              "agent.labels": options.labels}
    if options.engines:
        values["agent.mirror_url"] = options.mirror_url
    text = "# Written by `llmgw node add`, which writes it again on each run: change it with its flags.\n" + \
        settings.to_toml(values, fabrics=options.fabrics, engines=options.engines)
    path = shlex.quote(f"{prefix}/agent.toml")
    target.run(f"set -e; umask 077; cat > {path}.new; mv {path}.new {path}", stdin=text.encode(),
               what="writing the agent's configuration")


def _doctor(target: Target, options: Options, host: dict) -> str:
    """Run the doctor there; Failed with its failures unless --ignore-checks. What it found, in words."""
    prefix = shlex.quote(host["prefix"])
    code, out = target.run(f"cd {prefix} && .venv/bin/python doctor.py --config agent.toml", check=False,
                           what="the doctor", timeout=120)
    lines = out.splitlines()
    failures = [line.split(None, 2)[-1] + _fix(lines, i) for i, line in enumerate(lines) if line.startswith("FAIL")]
    warnings = sum(1 for line in lines if line.startswith("WARN"))
    note = f" ({warnings} warnings: `{prefix}/.venv/bin/python {prefix}/doctor.py --config {prefix}/agent.toml` " \
           "there shows them)" if warnings else ""
    if code == 0:
        return "the doctor passed" + note
    found = "; ".join(failures) or f"exit {code}: {out.strip()[-500:]}"
    if options.ignore_checks:
        return f"the doctor found failures, ignored (--ignore-checks): {found}"
    key = " (a key the controller refuses: run again with --new-key)" if "refuses this node's key" in found else ""
    raise Failed(f"the doctor found a problem there: {found}. Fix it and run node add again{key}, or give "
                 "--ignore-checks to start the agent regardless")


def _fix(lines: list[str], i: int) -> str:
    following = lines[i + 1].strip() if i + 1 < len(lines) else ""
    return f" ({following[1:].strip()})" if following.startswith("→") else ""


# Without systemd: stop the agent this command started before (by its pid file, only if that process is
# still this prefix's agent), then start it in its own session so it outlives the SSH connection.
DETACHED = """set -e
cd {prefix}
if [ -f agent.pid ] && tr '\\0' ' ' < /proc/$(cat agent.pid)/cmdline 2>/dev/null | grep -qF -- {prefix}/agent.py; then
  kill $(cat agent.pid)
  for i in $(seq 1 100); do kill -0 $(cat agent.pid) 2>/dev/null || break; sleep 0.2; done
fi
LLMGW_CONFIG={prefix}/agent.toml setsid nohup {prefix}/.venv/bin/python {prefix}/agent.py >> agent.log 2>&1 < /dev/null &
echo $! > agent.pid
"""


def _start(target: Target, host: dict) -> tuple[str, str]:
    """Start (or restart) the agent; how it runs, in words, and what that means."""
    prefix = host["prefix"]
    if host["systemd"] and host["uid"] == 0:
        # The deploy unit, run as its system user (made here when missing), who must own what the agent
        # reads and writes; the doctor ran as root before, and changed nothing there.
        unit = machine.unit_text("agent", machine.Layout(None), f"{prefix}/agent.toml", machine.USER,
                                 python=f"{prefix}/.venv/bin/python", scripts=prefix)
        p, user = shlex.quote(prefix), machine.USER
        target.run(f"set -e; id -u {user} >/dev/null 2>&1 || useradd --system --user-group --home-dir {p} "
                   f"--no-create-home --shell /usr/sbin/nologin {user}; mkdir -p {p}/weights {p}/work {p}/engines; "
                   f"chown -R {user}:{user} {p}/weights {p}/work {p}/engines; "
                   f"chown {user}:{user} {p}/node.key {p}/agent.toml; "
                   "cat > /etc/systemd/system/llmgw-agent.service; systemctl daemon-reload; "
                   "systemctl enable --quiet llmgw-agent; systemctl restart llmgw-agent", stdin=unit.encode(),
                   what="starting the agent's systemd unit")
        return "under systemd", f" (llmgw-agent.service as user {user}, enabled: it starts at boot)"
    target.run(DETACHED.format(prefix=shlex.quote(prefix)), what="starting the agent")
    why = "no systemd runs there" if not host["systemd"] else "the SSH user is not root, so no system unit"
    return "detached", (f", since {why}: it does not start again after a reboot (its log is {prefix}/agent.log; "
                        "run node add again to restart it)")


def _wait(target: Target, options: Options, host: dict, node: str, began: float) -> str:
    """Wait until the controller has NODE's registration since BEGAN, with its probed engines; them, in words."""
    deadline = time.monotonic() + options.wait_timeout
    while time.monotonic() < deadline:
        try:
            found = {n["node_id"]: n for n in options.admin.call("GET", "/api/v1/nodes")["nodes"]}.get(node)
        except ApiError:
            found = None  # the controller restarting; the deadline decides
        if found and found["state"] == "ready" and time.time() - found["registered_s"] >= began - 1 \
                and found["facts"].get("engines_probed"):
            engines = found["facts"].get("engines") or {}
            return ", ".join(f"{k} {v}" for k, v in sorted(engines.items())) or "none"
        time.sleep(0.5)
    _, tail = target.run(f"tail -n 15 {shlex.quote(host['prefix'])}/agent.log 2>/dev/null || "
                         "journalctl -u llmgw-agent -n 15 --no-pager 2>/dev/null", check=False, what="reading its log")
    raise Failed(f"the agent did not register within {options.wait_timeout:.0f} s; its last lines:\n{tail.rstrip()}\n"
                 "Check that the host reaches the controller's agent address (--controller), and the controller's log")
