"""The controller and agents as separate processes: registration, CURVE, node states, ctl."""

import json
import re
import time

import pytest
import zmq

from llmgw import keyfiles
from llmgw.procs import free_port, wait_for
from llmgw.wire import agent as protocol
from tests.cluster import Agent, Controller


@pytest.fixture
def cluster(tmp_path):
    made = []

    def controller(**settings):
        c = Controller(tmp_path, **settings)
        made.append(c)
        return c

    def agent(*args, **kwargs):
        a = Agent(tmp_path, *args, **kwargs)
        made.append(a)
        return a

    yield controller, agent
    for thing in reversed(made):
        thing.stop()


def test_agents_register_with_what_they_found(cluster):
    controller, agent = cluster
    c = controller()
    address = [f"127.0.0.1:{c.agent_port}"]
    agent(address, "gpu-a", c.issue_key("gpu-a"), labels={"rack": "r1"}, nvidia_smi_capture="nvidia-smi-8xh100.csv")
    agent(address, "gpu-b", c.issue_key("gpu-b"), labels={"rack": "r2"},
          nvidia_smi_capture="nvidia-smi-2xl40s-old-driver.csv")
    agent(address, "cpu-c", c.issue_key("cpu-c"))
    agent(address, "nvml-d", c.issue_key("nvml-d"), nvml_capture="nvml-4xa100.json")
    wait_for("four nodes", 10, lambda: len(c.nodes()) == 4)
    wait_for("every node ready", 30, lambda: all(n["state"] == "ready" for n in c.nodes().values()))
    nodes = c.nodes()
    a = nodes["gpu-a"]["facts"]
    assert a["labels"] == {"rack": "r1"} and a["address"] == "127.0.0.1"
    assert [g["class"] for g in a["gpus"]] == ["h100-80g"] * 8 and a["gpus_probed"] is True
    assert a["cpu"]["count"] >= 1 and "avx2" in a["cpu"]["flags"]
    assert a["memory"]["total_bytes"] > 0 and a["disk"]["free_bytes"] > 0
    assert a["engines_probed"] is True and "sim" in a["engines"] and "llamacpp" in a["engines"]
    assert nodes["cpu-c"]["facts"]["gpus"] == []  # probed: none, which is an answer
    # Heartbeats bring the load; GPU figures a driver cannot report stay absent.
    wait_for("heartbeat status", 30, lambda: "load" in c.nodes()["gpu-a"]["status"])
    metrics = c.metrics()
    assert 'llmgw_node_up{node="gpu-a",state="ready"} 1.0' in metrics
    assert 'llmgw_gpu_utilization_percent{gpu="4",node="gpu-a"} 97.0' in metrics
    assert 'llmgw_gpu_utilization_percent{gpu="0",node="gpu-b"}' not in metrics
    assert 'llmgw_gpu_memory_total_bytes{gpu="1",node="gpu-b"}' in metrics
    assert re.search(r'^llmgw_node_memory_used_bytes\{node="cpu-c"\} [1-9]', metrics, re.M)
    assert "llmgw_controller_leading 1.0" in metrics
    table = c.ctl("nodes").stdout
    assert re.search(r"gpu-a\s+ready", table) and "h100-80g" in table
    assert [g["class"] for g in nodes["nvml-d"]["facts"]["gpus"]] == ["a100-80g"] * 4  # through NVML
    status = c.ctl("status").stdout.splitlines()
    assert status[0] == "4 nodes: 4 ready" and status[1].startswith("leader: this controller (")


def test_a_key_nobody_issued_is_refused_and_the_agent_says_what_to_do(cluster):
    controller, agent = cluster
    c = controller()
    public, secret = zmq.curve_keypair()
    controller_public = (c.tmp / "controller-keys" / "controller.key").read_text()
    controller_public = re.search(r'public_key = "(.*)"', controller_public).group(1).encode()
    forged = keyfiles.node_key_file("intruder", public, secret, controller_public)
    a = agent([f"127.0.0.1:{c.agent_port}"], "intruder", forged)
    wait_for("the agent to report the refusal", 10, lambda: "refused this node's key" in a.log())
    assert "llmgw ctl node-key issue intruder" in a.log()
    assert "intruder" not in c.nodes()


def test_a_node_cannot_speak_for_another(cluster):
    controller, agent = cluster
    c = controller()
    key_for_a = c.issue_key("node-a")
    # node-a's genuine key, claiming to be node-b.
    a = agent([f"127.0.0.1:{c.agent_port}"], "node-b", key_for_a.replace('node_id = "node-a"', 'node_id = "node-b"'))
    wait_for("the refusal", 10, lambda: "refused this node" in a.log())
    assert "issued to 'node-a', not 'node-b'" in a.log()
    assert c.nodes() == {}


def test_unreachable_then_lost_then_removed(cluster):
    controller, agent = cluster
    c = controller()  # unreachable after 1 s of silence, lost after 2 s
    a = agent([f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    wait_for("n1 ready", 10, lambda: c.state("n1") == "ready")
    refused = c.ctl("node", "remove", "n1")
    assert refused.returncode == 1 and "only a lost node" in refused.stderr
    a.stop(sig=9)
    silent_since = time.monotonic()
    wait_for("n1 unreachable", 30, lambda: c.state("n1") == "unreachable", interval=0.05)
    became_unreachable = time.monotonic() - silent_since
    wait_for("n1 lost", 30, lambda: c.state("n1") == "lost", interval=0.05)
    became_lost = time.monotonic() - silent_since
    # The last heartbeat was up to one interval (0.2 s) before the kill.
    assert 0.7 <= became_unreachable <= 1.5 and 1.7 <= became_lost <= 2.5
    assert c.ctl("node", "remove", "n1").returncode == 0
    assert c.nodes() == {}


def test_cordon_holds_across_a_controller_restart_and_agents_register_again(cluster):
    controller, agent = cluster
    c = controller()
    agent([f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    agent([f"127.0.0.1:{c.agent_port}"], "n2", c.issue_key("n2"))
    wait_for("two nodes", 10, lambda: len(c.nodes()) == 2)
    assert c.ctl("cordon", "n1").returncode == 0
    assert c.state("n1") == "cordoned"
    c.stop()
    c.start(lead=True)  # same keys, same store, same port
    wait_for("both nodes back", 10, lambda: len(c.nodes()) == 2)
    assert c.state("n1") == "cordoned" and c.state("n2") == "ready"
    assert c.ctl("uncordon", "n1").returncode == 0
    assert c.state("n1") == "ready"
    assert c.ctl("cordon", "nonexistent").returncode == 1


def test_an_agent_tries_each_controller_address_in_turn(cluster):
    controller, agent = cluster
    c = controller()
    dead = f"127.0.0.1:{free_port()}"
    a = agent([dead, f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    wait_for("registration through the second address", 15, lambda: c.state("n1") == "ready")
    assert "nothing answers at " + dead in a.log()  # left at once: nothing listens there


def test_plaintext_only_on_purpose_and_said_at_start(cluster):
    controller, agent = cluster
    c = controller(controller__plaintext=True)
    assert "WITHOUT encryption" in c.log()
    agent([f"127.0.0.1:{c.agent_port}"], "plain", None, plaintext=True)
    wait_for("a plaintext node", 10, lambda: c.state("plain") == "ready")
    refused = c.ctl("node-key", "issue", "x")
    assert refused.returncode == 1 and "plaintext" in refused.stderr


def test_ctl_says_where_it_looked_when_the_controller_is_down(tmp_path):
    import subprocess
    import sys

    port = free_port()
    run = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--admin", f"http://127.0.0.1:{port}", "nodes"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and f"does not answer at http://127.0.0.1:{port}" in run.stderr


def test_ctl_json_for_scripts(cluster):
    controller, agent = cluster
    c = controller()
    agent([f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    wait_for("n1", 10, lambda: c.state("n1") == "ready")
    lines = c.ctl("nodes", "--json").stdout.splitlines()
    assert json.loads(lines[0])["node_id"] == "n1"
    assert json.loads(c.ctl("status", "--json").stdout)["nodes"]["ready"] == 1


def session(c, key_text: str):
    """A node's session as the wire sees it: a bare DEALER with the keys of KEY_TEXT, registered with C."""
    fields = dict(re.findall(r'^(\w+) = "(.*)"$', key_text, re.M))
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_secretkey = fields["secret_key"].encode()
    sock.curve_publickey = fields["public_key"].encode()
    sock.curve_serverkey = fields["controller_public_key"].encode()
    sock.connect(f"tcp://127.0.0.1:{c.agent_port}")
    assert answer(sock, "register", node_id=fields["node_id"], agent_version="t")["type"] == "registered"
    return context, sock


def answer(sock, kind: str, **fields) -> dict:
    sock.send(protocol.encode(kind, **fields))
    assert sock.poll(10_000), f"no answer to {kind}"
    return protocol.decode(sock.recv())


def refused_revoked(c) -> float:
    found = re.search(r'^llmgw_agent_messages_refused_total\{why="revoked"\} (\S+)$', c.metrics(), re.M)
    return float(found.group(1))


def test_revoking_a_node_key_ends_its_session_at_once_and_for_good(cluster):
    controller, agent = cluster
    c = controller()
    context, sock = session(c, c.issue_key("wire"))
    a = agent([f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    wait_for("n1 ready", 10, lambda: c.state("n1") == "ready" and "wire" in c.nodes())
    try:
        run = c.ctl("node-key", "revoke", "wire")
        revoked_at = time.monotonic()
        assert run.returncode == 0 and "session is refused" in run.stderr
        reply = answer(sock, "heartbeat", node_id="wire", seq=1)
        took = time.monotonic() - revoked_at
        print(f"the revoked session's next message was refused {took * 1000:.1f} ms after the revocation")
        assert reply["type"] == "refused" and "revoked" in reply["reason"] and took < 1.0
        assert answer(sock, "register", node_id="wire", agent_version="t")["type"] == "refused"
        assert refused_revoked(c) == 2.0 and "wire" not in c.nodes()
    finally:
        sock.close(0)
        context.term()
    # A real agent: told why, then refused at the handshake when it tries again, and never back.
    assert c.ctl("node-key", "revoke", "n1").returncode == 0
    wait_for("the agent told its key was revoked", 5, lambda: "key was revoked" in a.log())
    wait_for("its new handshake refused", 15, lambda: "refused this node's key" in a.log())
    assert "n1" not in c.nodes()
    again = c.ctl("node-key", "revoke", "n1")
    assert again.returncode == 1 and "no key is issued to 'n1'" in again.stderr


def test_issuing_a_node_key_again_ends_the_old_keys_session(cluster):
    controller, _ = cluster
    c = controller()
    context, old = session(c, c.issue_key("n1"))
    try:
        new_key = c.issue_key("n1")
        assert answer(old, "heartbeat", node_id="n1", seq=1)["type"] == "refused"
        new_context, new = session(c, new_key)
        new.close(0)
        new_context.term()
    finally:
        old.close(0)
        context.term()


SIM = {"name": "simmy", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
       "profiles": [{"engine": "sim", "args": ["--ttft-ms", "5"]}]}


def test_a_connected_node_is_removed_by_force_with_its_replicas_stopped(cluster):
    controller, agent = cluster
    c = controller(models=[SIM])
    a = agent([f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
    wait_for("a replica on n1", 60, lambda: c.ready("simmy") and len(a.engines()) == 1, interval=0.2)
    refused = c.ctl("node", "remove", "n1")
    assert refused.returncode == 1 and "node remove --force n1" in refused.stderr
    run = c.ctl("node", "remove", "--force", "n1")
    assert run.returncode == 0 and "1 replicas stopped" in run.stderr and "warning" not in run.stderr
    # The controller's loop forgets it at its next turn, a fraction of a second later on a busy machine.
    wait_for("n1 and its replicas forgotten", 5, lambda: "n1" not in c.nodes() and c.replicas() == [])
    wait_for("its engine stopped", 30, lambda: a.engines() == {})
    wait_for("its agent refused at the handshake", 15, lambda: "refused this node's key" in a.log())
    assert "n1" not in c.nodes() and c.replicas() == []
