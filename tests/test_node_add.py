"""`llmgw node add` against a real SSH server: a host becomes a node that serves a model through the gateway.

The "remote" machine is this one, reached through sshd on a loopback port as an unprivileged user, with
the test's own keys and known-hosts file, so everything node add does crosses SSH as it would to
another machine: the install, the key, the configuration, the doctor and the agent.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import tomllib
from types import SimpleNamespace

import pytest

from llmgw.cli import machine, nodeadd
from llmgw.node.shardfiles import running_engines
from llmgw.procs import free_port, wait_for
from tests.cluster import Controller
from tests.conftest import ROOT, Gateway, assert_units_valid, make_key, post, write_config
from tests.sshd import Sshd
from tests.test_engine_install import PLATFORM, SCRIPT, Files, tar_of

SIM = {"name": "simmy", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
       "profiles": [{"engine": "sim", "args": ["--ttft-ms", "5"]}]}


@pytest.fixture
def sshd(tmp_path):
    server = Sshd(tmp_path)
    yield server
    prefix = os.path.join(server.dir, "llmgw")
    try:
        with open(os.path.join(prefix, "agent.pid")) as f:
            os.kill(int(f.read()), signal.SIGTERM)
    except (OSError, ValueError):
        pass
    for pid in running_engines(os.path.join(prefix, "work")).values():
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    server.stop()


def node_add(controller: Controller, *args: str, config: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "--config", config or controller.config, "node", "add",
                           *args], capture_output=True, text=True, timeout=900)


def test_a_host_reached_over_ssh_becomes_a_node_that_serves_a_model(tmp_path, sshd):
    # The agent heartbeats every 5 s as installed, so the controller keeps its own patience too.
    c = Controller(tmp_path, models=[SIM], controller__unreachable_after=15.0, controller__lost_after=60.0)
    gateway = Gateway(tmp_path, c.values["store.url"], gateway__controller=f"127.0.0.1:{c.gateway_port}",
                      gateway__key_file=c.gateway_key_file(), gateway__load_wait=60)
    key = make_key(c.values["store.url"])  # made now, so the gateways have it by the end
    try:
        prefix = os.path.join(sshd.dir, "llmgw")
        login = f"{sshd.user}@127.0.0.1"
        node = socket.gethostname().split(".")[0]

        # A controller address nothing answers at: installed and checked, but the doctor stops it before
        # the agent starts.
        closed = free_port()
        run = node_add(c, *sshd.ssh_flags(), "--dir", prefix, "--controller", f"127.0.0.1:{closed}",
                       "--fabric", "ib-a:mlx5_0,mlx5_1", login)
        assert run.returncode == 1, run.stderr
        with open(os.path.join(prefix, "agent.toml"), "rb") as f:
            assert tomllib.load(f)["fabrics"] == [{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"]}]
        assert f"✗ {login}: failed running the doctor: the doctor found a problem there" in run.stderr, run.stderr
        assert "--ignore-checks" in run.stderr and "agent started" not in run.stderr
        assert os.stat(os.path.join(prefix, "node.key")).st_mode & 0o777 == 0o600
        assert not os.path.exists(os.path.join(prefix, "agent.pid"))

        # Again, right, beside a host that refuses the login: the one is added, the other says what to do. The
        # control plane's engine catalogue goes to the node, which installs llama.cpp from it at once.
        (tmp_path / "served").mkdir()
        files = Files(tmp_path / "served")
        entry = {"name": "llamacpp", "version": "b7", "source": "llama.tar.gz", "sha256": {PLATFORM: files.publish(
            "llama.tar.gz", tar_of({"bin/llama-server": SCRIPT.format(version="b7").encode()}))}}
        with_engines = write_config(tmp_path / "with-engines.toml", {**c.values, "mirror.base_url": files.url},
                                    models=[SIM], engines=[entry])
        run = node_add(c, *sshd.ssh_flags(), "--dir", prefix, "--wait-engine", "llamacpp", login,
                       "nobody-here@127.0.0.1", config=with_engines)
        files.server.shutdown()
        files.server.server_close()
        assert run.returncode == 1, run.stderr
        assert f"{login}: installed llamacpp b7" in run.stderr, run.stderr
        assert f"✓ {login}: node {node} is ready, engines: " in run.stderr and "llamacpp b7 (installed now)" \
            in run.stderr, run.stderr
        with open(os.path.join(prefix, "agent.toml"), "rb") as f:
            written = tomllib.load(f)
        assert written["engines"] == [entry] and written["agent"]["mirror_url"] == files.url
        assert os.path.exists(os.path.join(prefix, "engines", "llamacpp", "b7", "bin", "llama-server"))
        assert "kept the node's key it holds" in run.stderr  # the key of the first run: still this node's
        assert "agent started detached, since no systemd runs there" in run.stderr
        assert "✗ nobody-here@127.0.0.1: failed checking the host: nobody-here@127.0.0.1 (port" in run.stderr
        assert "ssh-copy-id nobody-here@127.0.0.1" in run.stderr
        assert "1 of 2 hosts added; failed: nobody-here@127.0.0.1" in run.stderr
        assert c.state(node) == "ready"

        # The controller places the model there, and it answers through the gateway.
        wait_for("simmy ready on the new node", 90, lambda: [r for r in c.ready("simmy") if r["node"] == node],
                 interval=0.5)
        status, _, body = post(gateway.url + "/v1/chat/completions",
                               {"model": "simmy", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
                               key, timeout=90)
        assert status == 200, body
        # It runs as the login user, as an engine on another machine would.
        engines = list(running_engines(os.path.join(prefix, "work")).values())
        assert len(engines) == 1 and os.stat(f"/proc/{engines[0]}").st_uid == pwd.getpwnam(sshd.user).pw_uid

        # Another machine with the same host name (here: another directory) must not take that node's key.
        elsewhere = os.path.join(sshd.dir, "elsewhere")
        run = node_add(c, *sshd.ssh_flags(), "--dir", elsewhere, login)
        assert run.returncode == 1
        assert f"failed checking the host: the controller already has a node called {node} (ready" in run.stderr
        assert "--name NAME" in run.stderr and not os.path.exists(elsewhere)
        assert c.state(node) == "ready"
    finally:
        gateway.stop()
        c.stop()


def test_a_host_whose_key_ssh_does_not_know_is_refused_with_what_to_do(tmp_path, sshd):
    c = Controller(tmp_path)
    try:
        strangers = tmp_path / "empty_known_hosts"
        strangers.write_text("")
        flags = [f if f != str(sshd.known_hosts) else str(strangers) for f in sshd.ssh_flags()]
        run = node_add(c, *flags, f"{sshd.user}@127.0.0.1")
        assert run.returncode == 1
        assert "ssh does not know 127.0.0.1's host key" in run.stderr and "--known-hosts FILE" in run.stderr, run.stderr
        assert not os.path.exists(os.path.join(sshd.dir, "llmgw")) and c.nodes() == {}
    finally:
        c.stop()


def test_the_agent_unit_written_to_a_host_that_runs_systemd_is_valid(tmp_path):
    # Here no host runs systemd, so node add starts agents detached; the unit it writes for one that does
    # (as root) is checked by systemd itself, pointing at this machine's Python as it would at the host's.
    unit = tmp_path / "llmgw-agent.service"
    unit.write_text(machine.unit_text("agent", machine.Layout(None), "/home/ops/llmgw/agent.toml", machine.USER,
                                      python=sys.executable, scripts=ROOT))
    text = unit.read_text()
    assert f"ExecStart={sys.executable} {ROOT}/agent.py" in text and "LLMGW_CONFIG=/home/ops/llmgw/agent.toml" in text
    assert_units_valid([unit])


def test_an_agent_under_systemd_owns_where_it_installs_engines():
    host = Host(uid=0, systemd=True, prefix="/opt/llmgw")
    how, _ = nodeadd._start(host, host.facts)
    assert how == "under systemd"
    assert "chown -R llmgw:llmgw /opt/llmgw/weights /opt/llmgw/work /opt/llmgw/engines;" in host.ran[0]


class Host:
    """A host as node add's probe sees it: what its python3 printed, over a Target that runs nothing."""

    def __init__(self, **facts):
        self.facts = {"python": list(sys.version_info[:2]), "executable": "/usr/bin/python3",
                      "machine": os.uname().machine, "has_venv": True, "uid": 1000, "hostname": "gpu-07",
                      "systemd": False, "prefix": "/home/ops/llmgw", "free": 500 << 30, "ssh_from": "", **facts}

        self.ran: list[str] = []

    def run(self, command, **_):
        self.ran.append(command)
        if "apt-get" in command or "dnf install" in command:  # what the package gives
            self.facts["has_venv"] = True
            return 0, ""
        return 0, "a login banner\n" + json.dumps(self.facts) + "\n"


@pytest.mark.parametrize("facts, says", [
    ({"python": [3, 9]}, "is Python 3.9; llmgw needs 3.11 or later: install python"),
    ({"has_venv": False}, "cannot make virtual environments: install it there (the package that gives Python its "
                          "venv module), or run node add as root there"),
    ({"has_venv": False, "os": {"ID": "ubuntu", "ID_LIKE": "debian"}},
     f"apt-get -o DPkg::Lock::Timeout=600 install -y -qq python{sys.version_info[0]}.{sys.version_info[1]}-venv), "
     "or run node add as root there"),
    ({"machine": "aarch64"}, "the wheels of this installation are for Python"),
    ({"python": [3, 99]}, "and give --python python"),
    ({"free": 1 << 30}, "only 1.0 GiB is free for /home/ops/llmgw; llmgw needs about 3 GiB: free some space"),
])
def test_a_host_that_cannot_take_this_installation_is_refused_with_what_to_do(facts, says):
    options = SimpleNamespace(python="python3", prefix="")
    with pytest.raises(nodeadd.Failed) as e:
        nodeadd._probe(Host(**facts), options, 600 << 20)
    assert says in str(e.value), str(e.value)
    assert nodeadd._probe(Host(), options, 600 << 20)["hostname"] == "gpu-07"


def test_as_root_a_host_gets_pythons_venv_from_its_own_package_manager_by_family():
    # Lesson 49: decided by ID_LIKE, so a derivative is not refused for a name nobody listed; lesson 50: a
    # fresh machine's apt lock is waited for, its lists' lock included.
    options = SimpleNamespace(python="python3", prefix="")
    mint = Host(has_venv=False, uid=0, os={"ID": "linuxmint", "ID_LIKE": "ubuntu debian"})
    assert nodeadd._probe(mint, options, 600 << 20)["has_venv"]
    (install,) = [c for c in mint.ran if "apt-get" in c]
    assert "fuser /var/lib/apt/lists/lock" in install and "DPkg::Lock::Timeout=600" in install
    rocky = Host(has_venv=False, uid=0, os={"ID": "rocky", "ID_LIKE": "rhel centos fedora"})
    assert nodeadd._probe(rocky, options, 600 << 20)["has_venv"] and any("dnf install" in c for c in rocky.ran)
    assert nodeadd.family({"ID": "opensuse-leap", "ID_LIKE": "suse opensuse"}) == "zypper"
    assert nodeadd.install_command({"ID": "arch"}, ["python"]) is None  # not guessed: the operator installs it


def test_what_a_host_or_its_node_says_is_printed_inert(capsys):
    # A node's install failure, a doctor's finding or an agent's log lines come from the host: a terminal escape
    # in them would act on the operator's terminal.
    nodeadd.Batch().say("root@gpu-01", "installing vllm/1\x1b]0;pwned\x07 failed\nfix: \x1b[2Jcheck the disk")
    said = capsys.readouterr().err
    assert "\x1b" not in said and "\x07" not in said and "\\x1b]0;pwned\\x07" in said
    assert said.count("\n") == 2  # line by line, as the host wrote it
