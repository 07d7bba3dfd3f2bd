"""The fabric test: perftest's ib_write_bw run through two real agents by a real controller, rail by rail,
graded against the link rate (a replayed ib_write_bw: tests/fake-perftest, output in perftest's shape,
tests/fixtures/ib_write_bw-*.txt); its pieces on their own; and what it refuses."""

import json
import os
import subprocess
import sys

import pytest

from llmgw.control import fabrictest
from llmgw.control.fleet import NodeView, node_facts
from llmgw.node import perftest
from llmgw.procs import wait_for
from tests.cluster import Agent, Controller
from tests.conftest import ROOT, post
from tests.test_fabric_discovery import FABRIC_ENV, fixture, ib_port

FAKE_PERFTEST = os.path.join(ROOT, "tests", "fake-perftest")
A = "sm:0x248a0703005a0012"


def test_the_command_line_and_the_result_table():
    assert perftest.args("mlx5_0", 1, 18515, 3) == ["ib_write_bw", "-d", "mlx5_0", "-i", "1", "-p", "18515", "-D", "3",
                                                    "-F", "--report_gbits"]
    roce = perftest.args("mlx5_2", 1, 18516, 3, gid_index=3, peer="10.0.0.2")
    assert roce[-3:] == ["-x", "3", "10.0.0.2"]  # RoCE's v2 entry; the peer last, as perftest wants it
    assert perftest.parse(fixture("ib_write_bw-ndr.txt")) == 388.21
    with pytest.raises(ValueError, match="printed no result"):
        perftest.parse(fixture("ib_write_bw-no-server.txt"))
    moved = fixture("ib_write_bw-ndr.txt").replace(" 0.740478", "")
    with pytest.raises(ValueError, match="a shape this does not know"):
        perftest.parse(moved)


def test_a_node_runs_only_a_sane_test_on_a_port_it_has():
    ports = [{"hca": "mlx5_0", "port": 1, "state": "ACTIVE"}, {"hca": "mlx5_1", "port": 1, "state": "DOWN",
                                                                "phys_state": "Polling"}]
    client = {"role": "client", "hca": "mlx5_0", "port": 1, "tcp_port": 18515, "seconds": 3, "peer": "10.0.0.2"}
    assert perftest.answer({**client, "peer": "-x7"}, ports)["error"].startswith("the peer of a fabric test is an IP")
    assert perftest.answer({**client, "hca": "mlx5_9"}, ports) == {"error": "no port mlx5_9/1 here"}
    assert perftest.answer({**client, "hca": "mlx5_1"}, ports) == {"error": "mlx5_1/1 is DOWN (Polling)"}
    assert "a server or a client" in perftest.answer({**client, "seconds": 600}, ports)["error"]
    assert "a server or a client" in perftest.answer({**client, "role": "both"}, ports)["error"]


def test_perftest_is_installed_on_first_use(tmp_path, monkeypatch):
    # A package manager that installs ib_write_bw into a directory on the PATH, as apt-get would into /usr/bin.
    managers, bin_dir = tmp_path / "managers", tmp_path / "bin"
    managers.mkdir()
    bin_dir.mkdir()
    (managers / "apt-get").write_text(f"#!/bin/sh\necho \"$*\" > {tmp_path}/asked\n"
                                      f"cp {FAKE_PERFTEST}/ib_write_bw {bin_dir}/ib_write_bw\n")
    (managers / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{managers}{os.pathsep}{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert perftest.ensure_installed() is None
    assert (tmp_path / "asked").read_text() == "install -y perftest\n" and (bin_dir / "ib_write_bw").exists()
    (managers / "apt-get").write_text("#!/bin/sh\necho 'E: Unable to locate package perftest' >&2; exit 100\n")
    (bin_dir / "ib_write_bw").unlink()
    assert perftest.ensure_installed() == "installing perftest with apt-get failed: E: Unable to locate package perftest"


def node(node_id, fabrics, features=("fabric-test",), state="ready"):
    registration = {"fabrics": fabrics, "features": list(features),
                    "ib_ports": [{"hca": h, "port": 1, "state": "ACTIVE", "rate_gbps": 400.0}
                                 for f in fabrics for h in f["adapters"]]}
    return NodeView(node_id, state, 0, 0, node_facts(registration, {}), address="10.0.0.2")


def test_what_a_fabric_test_refuses_before_asking_anyone():
    ib_a = {"name": "ib-a", "physical": A, "adapters": ["mlx5_0"]}
    other = {"name": "ib-a", "physical": "sm:0x00000000000000bb", "adapters": ["mlx5_0"]}
    asked = []

    def ask(*args):
        asked.append(args)

    for nodes, words in [([node("a", [ib_a]), node("b", [ib_a], features=())], "the agent on b does not run fabric tests"),
                         ([node("a", [ib_a]), node("b", [other])], "a and b do not share a fabric"),
                         ([node("a", [ib_a]), node("b", [ib_a], state="lost")], "b is lost"),
                         ([node("a", [ib_a])], "no node 'b'")]:
        with pytest.raises(fabrictest.TestRefused, match=words):
            fabrictest.run(nodes, "a", "b", None, 3, ask)
    two = [ib_a, {"name": "ib-b", "physical": "sm:0x00000000000000cc", "adapters": ["mlx5_1"]}]
    with pytest.raises(fabrictest.TestRefused, match="share 2 fabrics .* say which with --fabric"):
        fabrictest.run([node("a", two), node("b", two)], "a", "b", None, 3, ask)
    assert asked == []
    assert fabrictest.rails(["mlx5_1", "mlx5_0"], ["mlx5_0", "mlx5_1"]) == [("mlx5_0", "mlx5_0"), ("mlx5_1", "mlx5_1")]
    assert fabrictest.rails(["mlx5_0"], ["mlx5_4"]) == [("mlx5_0", "mlx5_4")]
    # Partly overlapping names: the common ones by name, the rest in order, one left without a partner.
    assert fabrictest.rails(["mlx5_0", "mlx5_1", "ibp2"], ["mlx5_0", "ibp7"]) == [
        ("mlx5_0", "mlx5_0"), ("ibp2", "ibp7"), ("mlx5_1", None)]
    assert [fabrictest.grade(g, 400.0) for g in (388.2, 250.0, 100.0, None)] == ["ok", "slow", "fail", "fail"]


def test_a_rail_that_is_down_fails_the_test_without_running():
    ib_a = {"name": "ib-a", "physical": A, "adapters": ["mlx5_0"], "declared": ["mlx5_0", "mlx5_1"]}
    a = node("a", [ib_a])
    b = node("b", [{**ib_a, "adapters": ["mlx5_0", "mlx5_1"]}])
    asked = []

    def ask(node_id, kind, fields, timeout):
        asked.append((node_id, fields["hca"]))
        return {"gbps": 390.0}

    result = fabrictest.run([a, b], "a", "b", None, 3, ask)
    assert not result["passed"] and [r["grade"] for r in result["rails"]] == ["ok", "fail"]
    assert result["rails"][1]["error"] == "mlx5_1 on a is not active"
    assert sorted(asked) == [("a", "mlx5_0"), ("b", "mlx5_0")]  # the rail that is down was not run


def test_two_agents_test_their_fabric_rail_by_rail(tmp_path):
    trees = {}
    for name in ("a", "b"):
        trees[name] = tmp_path / name
        ib_port(trees[name], "mlx5_0")
        ib_port(trees[name], "mlx5_1")
    slow = tmp_path / "slow.txt"
    slow.write_text(fixture("ib_write_bw-ndr.txt").replace("388.21", "251.40"))
    ctl = Controller(tmp_path)
    agents = []
    try:
        for name, table in (("a", os.path.join(ROOT, "tests", "fixtures", "ib_write_bw-ndr.txt")), ("b", str(slow))):
            env = {**FABRIC_ENV, "PATH": FAKE_PERFTEST + os.pathsep + FABRIC_ENV["PATH"], "LLMGW_FAKE_WRITE_BW": table,
                   "LLMGW_FAKE_WRITE_BW_LOG": str(tmp_path / f"{name}-asked.txt")}
            agents.append(Agent(tmp_path, [f"127.0.0.1:{ctl.agent_port}"], name, ctl.issue_key(name), env=env,
                                fabrics=[{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"]}],
                                agent__infiniband_dir=str(trees[name] / "sys/class/infiniband")))
        wait_for("both nodes on the fabric", 60,
                 lambda: all(ctl.nodes().get(n, {}).get("facts", {}).get("fabrics") for n in ("a", "b")))
        run = subprocess.run([sys.executable, "-m", "llmgw", "--config", ctl.config, "ctl", "fabric-test", "a", "b",
                              "--seconds", "1"], capture_output=True, text=True, timeout=300)
        # a's client read 388.21 Gb/s on each rail: ok against 400.
        assert run.returncode == 0, run.stdout + run.stderr
        assert "fabric ib-a (sm:0x248a0703005a0012), 1 s a rail" in run.stdout
        assert run.stdout.count("388.2") == 2 and run.stdout.count(" ok") == 2
        asked = (tmp_path / "a-asked.txt").read_text().splitlines()
        port = int(asked[0].split(" -p ")[1].split()[0])  # a random step above perftest's 18515
        assert asked == [f"-d mlx5_0 -i 1 -p {port} -D 1 -F --report_gbits 127.0.0.1",
                         f"-d mlx5_1 -i 1 -p {port + 1} -D 1 -F --report_gbits 127.0.0.1"]
        assert (tmp_path / "b-asked.txt").read_text().splitlines()[0] == f"-d mlx5_0 -i 1 -p {port} -D 1 -F --report_gbits"
        # The other way round, b's client reads 251.4: slow, and the command says so with its exit status.
        run = subprocess.run([sys.executable, "-m", "llmgw", "--config", ctl.config, "ctl", "fabric-test", "b", "a",
                              "--seconds", "1", "--fabric", "ib-a"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 1 and run.stdout.count(" slow") == 2, run.stdout + run.stderr
        refused = subprocess.run([sys.executable, "-m", "llmgw", "--config", ctl.config, "ctl", "fabric-test", "a", "b",
                                  "--fabric", "ib-z"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "do not share fabric ib-z" in refused.stderr
        # The API's own checks, before any node is asked: each a 400 saying what to send.
        for body, words in [([], "send {\"a\": NODE, \"b\": NODE}"), ({"a": "a"}, "send {\"a\": NODE"),
                            ({"a": "a", "b": "../etc"}, "send {\"a\": NODE"), ({"a": "a", "b": "a"}, "name two"),
                            ({"a": "a", "b": "b", "seconds": 31}, "1 to 30"),
                            ({"a": "a", "b": "b", "seconds": True}, "1 to 30"),
                            ({"a": "a", "b": "b", "fabric": "x" * 65}, "fabric is the name"),
                            ({"a": "a", "b": "b", "fabric": 7}, "fabric is the name")]:
            status, _, answer = post(f"http://127.0.0.1:{ctl.admin_port}/api/v1/fabric-test", body, key=ctl.token())
            assert status == 400 and words in json.loads(answer)["error"], (body, answer)
        assert (tmp_path / "a-asked.txt").read_text().count("\n") == 4  # the two runs above, two rails each
    finally:
        for agent in agents:
            agent.stop()
        ctl.stop()
