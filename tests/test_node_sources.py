"""A node reads local weights only from its weights directory and the directories `agent.local_sources`
lists: an administrator cannot make a node's engine open another file, and hears why the replica failed.

Before, a catalog model with `source = "/etc/shadow"` was accepted, placed, and llama.cpp printed the
file's first bytes into the shard's log (`invalid magic characters: 'root'`), which `llmgw ctl logs`
shows. The controller cannot know a node's directories, so the node refuses, and no engine is started.
"""

from __future__ import annotations

import http.server
import threading

import pytest

from llmgw import settings
from llmgw.control.catalog import CatalogError, check_source, source_checks
from llmgw.procs import wait_for
from tests.cluster import Agent, Controller


def test_a_catalog_source_outside_the_nodes_directories_fails_with_the_reason(tmp_path):
    listed = tmp_path / "models"
    listed.mkdir()
    (listed / "shadow.gguf").symlink_to("/etc/shadow")
    made = []
    try:
        c = Controller(tmp_path)
        made.append(c)
        made.append(Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"),
                          agent__local_sources=[str(listed)]))
        wait_for("the node", 30, lambda: c.state("n1") == "ready", interval=0.2)
        for name, source in (("probe", "/etc/shadow"), ("linked", str(listed / "shadow.gguf"))):
            (tmp_path / f"{name}.toml").write_text(f'name = "{name}"\nsource = "{source}"\n'
                                                   'scaling = {min = 1, max = 1}\n[[profiles]]\nengine = "llamacpp"\n')
            # Accepted: /etc/shadow exists on the controller's machine, which cannot know the node's directories.
            added = c.ctl("model", "add", "-f", str(tmp_path / f"{name}.toml"),
                          *(["--no-source-check"] if name == "linked" else []))
            assert added.returncode == 0, added.stderr

            def failure(name=name):
                model = next(m for m in c.api("/api/v1/models")["models"] if m["name"] == name)
                return model["last_failure"]

            wait_for(f"{name} to fail on n1", 30, failure, interval=0.2)
            assert "add its directory to agent.local_sources" in failure()["detail"], failure()
            shards = {r["shard_id"] for r in c.replicas(name)}
            for shard in shards:
                logs = c.ctl("logs", "n1", "--source", shard)
                assert "root" not in logs.stdout and "invalid magic" not in logs.stdout
        assert "refused shard" in made[1].log()
        assert not list((tmp_path / "agent-n1" / "work" / "shards").glob("*.log"))  # no engine ever started
    finally:
        for thing in reversed(made):
            thing.stop()


def test_the_catalog_wants_a_url_or_an_absolute_path_and_the_node_absolute_directories(tmp_path):
    # A relative path would be read from the engine's working directory (the agent's work_dir), where
    # `../../etc/shadow` leads anywhere.
    with pytest.raises(CatalogError, match="neither an http\\(s\\) URL nor an absolute path"):
        check_source("../../etc/shadow", source_checks([], ""))
    with pytest.raises(CatalogError, match="agent.local_sources"):
        check_source("models/m.gguf", source_checks([], ""))
    with pytest.raises(settings.ConfigError, match="agent.local_sources: 'models' must be absolute paths"):
        settings.load(None, {"agent.local_sources": "models"})


class Recorder(http.server.BaseHTTPRequestHandler):
    """A server inside the network: it answers every HEAD, and keeps what it was asked (in `server.asked`)."""

    def do_HEAD(self):
        self.server.asked.append(self.path)
        if self.path.startswith("/to/"):  # a redirect to another server of this network
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.path.split('/')[2]}/secret")
        else:
            self.send_response(200)
            self.send_header("Content-Length", "12345")
        self.end_headers()

    def log_message(self, *args):
        pass


def inside():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.asked = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_controller_probes_no_address_inside_the_network_for_a_source(tmp_path):
    # The check of a source once sent a HEAD to any URL an administrator gave, and said whether it answered:
    # a probe of every port inside the network for whoever holds the admin token.
    service, mirror = inside(), inside()
    c = Controller(tmp_path, mirror__base_url=f"http://127.0.0.1:{mirror.server_port}")
    try:
        def add(name, source):
            (tmp_path / f"{name}.toml").write_text(f'name = "{name}"\nsource = "{source}"\n'
                                                   '[[profiles]]\nengine = "sim"\n')
            return c.ctl("model", "add", "-f", str(tmp_path / f"{name}.toml"))

        for name, source in (("probe", f"http://127.0.0.1:{service.server_port}/metrics"),
                             ("spelt", f"http://2130706433:{service.server_port}/metrics"),
                             ("bounced", f"http://127.0.0.1:{mirror.server_port}/to/{service.server_port}")):
            refused = add(name, source)
            assert refused.returncode == 1 and "is a loopback address" in refused.stderr, refused.stderr
            assert "controller.source_allow" in refused.stderr and "--no-source-check" in refused.stderr
        assert service.asked == []  # never reached, a redirect from the mirror's address included
        # Its own mirror is where sources live: checked, and its size kept for placement.
        added = add("mirrored", f"http://127.0.0.1:{mirror.server_port}/m/v1/m.gguf")
        assert added.returncode == 0, added.stderr
        assert [m["name"] for m in c.api("/api/v1/models")["models"]] == ["mirrored"]
        # A network the operator lists is checked.
        assert check_source(f"http://127.0.0.1:{service.server_port}/m", source_checks(["127.0.0.0/8"], "")) == 12345
    finally:
        c.stop()
        for server in (service, mirror):
            server.shutdown()
            server.server_close()
