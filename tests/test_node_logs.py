"""What `llmgw ctl logs` and the admin API read on a node: sources are names the agent lists, never paths.

Before, the agent joined the source asked for onto its shards folder (`os.path.join(work_dir, "shards",
source + ".log")`), so `llmgw ctl logs NODE --source /var/log/dpkg` printed the node's /var/log/dpkg.log
and `--source ../../agent` the file beside the agent's work directory: whoever holds the admin token read
any file ending in `.log` the agent could open.
"""

from __future__ import annotations

import json
import logging
import urllib.error

import pytest

from llmgw.node.commands import commands
from llmgw.node.logsources import LogRing, LogSources
from llmgw.node.supervisor import Supervisor
from llmgw.procs import wait_for
from tests.cluster import Agent, Controller


@pytest.fixture
def node(tmp_path):
    made = []
    try:
        c = Controller(tmp_path, models=[{"name": "m", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
                                          "profiles": [{"engine": "sim", "args": ["--ttft-ms", "1"]}]}])
        made.append(c)
        made.append(Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1")))
        wait_for("the replica", 60, lambda: [r for r in c.replicas("m") if r["state"] == "ready"], interval=0.2)
        yield c, made[1], tmp_path
    finally:
        for thing in reversed(made):
            thing.stop()


def test_a_source_is_a_name_never_a_path(node):
    c, agent, tmp_path = node
    outside = tmp_path / "outside.log"
    outside.write_text("a secret line outside the agent's folders\n")
    # ../../agent is the test harness's own log of the agent, beside its work directory.
    for source in (str(tmp_path / "outside"), "/var/log/dpkg", "../../agent", "../../../outside", "/etc/passwd"):
        run = c.ctl("logs", "n1", "--source", source)
        assert run.returncode == 1 and run.stdout == "", (source, run.stdout[:300])
        assert "is not a source: a source is a name the node lists (agent, or a shard id), never a path" in \
            run.stderr, run.stderr
    for source in ("..", "dpkg", "agent.log"):  # names, but not the node's
        run = c.ctl("logs", "n1", "--source", source)
        assert run.returncode == 1 and run.stdout == "", (source, run.stdout[:300])
        assert f"no source {source!r} on n1; its sources are agent, m-" in run.stderr, run.stderr


def test_the_agent_itself_refuses_a_path_whatever_the_controller_let_by(tmp_path):
    # The controller refuses a source with a slash; the agent must not rely on it (an older controller does not).
    (tmp_path / "work" / "shards").mkdir(parents=True)
    (tmp_path / "work" / "shards" / "old-1.log").write_text("the old shard's last words\n")
    (tmp_path / "secret.log").write_text("not a log of the agent's\n")
    supervisor = Supervisor("n1", str(tmp_path / "work"), str(tmp_path / "weights"), "127.0.0.1", "127.0.0.1",
                            report=lambda fields: None)
    ring = LogRing()
    ring.emit(logging.LogRecord("llmgw.agent", logging.INFO, __file__, 1, "connected", None, None))
    handle = commands("n1", supervisor, LogSources(ring, supervisor.engine_logs))

    def ask(**fields):
        [(kind, reply)] = handle({"type": "logs_request", "request_id": "r", **fields})
        assert kind == "logs_reply" and reply["request_id"] == "r"
        return reply

    assert ask()["sources"] == ["agent", "old-1"]
    assert ask(source="old-1")["lines"] == ["the old shard's last words"]
    assert ask(source="agent")["lines"] == ["connected"]
    for source in (str(tmp_path / "secret"), "../../secret", "../work/shards/old-1", "old-1.log", ""):
        reply = ask(source=source)
        assert "lines" not in reply and reply["error"] == (f"no source {source!r} on n1; its sources are agent, "
                                                           "old-1"), source


def test_ctl_logs_reads_the_agents_own_lines_and_an_engines_and_follows_them(node):
    c, agent, tmp_path = node
    run = c.ctl("logs", "n1")
    assert run.returncode == 0, run.stderr
    assert "registered with the controller" in run.stdout and "INFO llmgw.controllerlink" in run.stdout
    shard = c.replicas("m")[0]["shard_id"]
    assert f"agent on n1; its other sources: {shard}" in run.stderr
    three = c.ctl("logs", "n1", "-n", "3")
    assert three.returncode == 0 and len(three.stdout.splitlines()) == 3
    engine = c.ctl("logs", "n1", "--source", shard, "--lines", "5")
    assert engine.returncode == 0 and "llmgw: starting" in engine.stdout
    assert c.ctl("logs", "n1", "-n", "2001").returncode == 2  # click's own refusal: at most what is kept

    # Following: a cursor from one answer, and the next holds only what the agent logged since.
    first = c.api("/api/v1/nodes/n1/logs?source=agent&lines=2000")
    assert first["lines"] and isinstance(first["cursor"], int)
    (tmp_path / "more.toml").write_text('name = "more"\nsource = "/dev/null"\nscaling = {min = 1, max = 1}\n'
                                        '[[profiles]]\nengine = "sim"\n')
    assert c.ctl("model", "add", "-f", str(tmp_path / "more.toml"), "--no-source-check").returncode == 0

    def since():
        return c.api(f"/api/v1/nodes/n1/logs?source=agent&after={first['cursor']}")

    wait_for("the agent to log the new shard", 60, lambda: any("(more): ready" in line for line in since()["lines"]))
    later = since()
    assert later["skipped"] is False and not set(later["lines"]) & set(first["lines"][-5:])
    assert c.api(f"/api/v1/nodes/n1/logs?source=agent&after={later['cursor']}")["lines"] == []


def test_the_admin_api_refuses_a_bad_logs_query_in_a_sentence(node):
    c, _, _ = node
    for query, refusal in (
            ("lines=0", "lines is a whole number from 1 to 2000"), ("lines=%C2%B2", "lines is a whole number"),
            ("lines=2001", "lines is a whole number"), ("after=-1", "after is a cursor"),
            ("after=1e3", "after is a cursor"), ("source=..%2F..%2Fetc%2Fpasswd", "never a path"),
            ("source=/var/log/dpkg", "never a path"), ("source=nope", "no source 'nope' on n1; its sources are agent, ")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            c.api(f"/api/v1/nodes/n1/logs?{query}")
        assert refused.value.code in (400, 404) and refusal in json.loads(refused.value.read())["error"], query


def test_every_command_a_controller_sends_is_forwarded_and_answered(tmp_path):
    # The Go version's dispatcher forwarded each request by hand, and one added to the agent but not to the
    # forwarder was silently absent: every controller -> agent request in the protocol must be both in the
    # link's list (llmgw/node/controllerlink.py) and answered by the agent's commands, none falling through.
    from llmgw.node.controllerlink import COMMANDS
    from llmgw.wire import agent as protocol

    requests = {kind for kind, fields in protocol.MESSAGES.items() if "request_id" in fields and
                not kind.endswith("_reply") and kind != "ack"}
    assert requests == set(COMMANDS), requests ^ set(COMMANDS)
    (tmp_path / "work").mkdir()
    supervisor = Supervisor("n1", str(tmp_path / "work"), str(tmp_path / "weights"), "127.0.0.1", "127.0.0.1",
                            report=lambda fields: None)
    sent = []
    handle = commands("n1", supervisor, LogSources(LogRing(), supervisor.engine_logs), send=sent.append)
    samples = {"stop_shard": {"shard_id": "s"}, "drain_shard": {"shard_id": "s", "timeout": 0.1},
               "remove_weights": {"source": "/nowhere"}, "logs_request": {}, "weights_request": {},
               "reclaim_weights": {"names": []}, "scan_fabric": {"hca": "mlx5_0", "port": 1}}
    for kind, fields in samples.items():
        replies = handle({"type": kind, "request_id": "r", **fields})
        answered = replies or wait_for(f"{kind}'s reply", 10, lambda: sent) or sent
        assert any(reply["request_id"] == "r" for _, reply in answered), kind
        sent.clear()
    with pytest.raises(ValueError, match="no command 'reboot'"):
        handle({"type": "reboot", "request_id": "r"})
