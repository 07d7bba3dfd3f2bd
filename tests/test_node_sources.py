"""A node reads local weights only from its weights directory and the directories `agent.local_sources`
lists: an administrator cannot make a node's engine open another file, and hears why the replica failed.

Before, a catalog model with `source = "/etc/shadow"` was accepted, placed, and llama.cpp printed the
file's first bytes into the shard's log (`invalid magic characters: 'root'`), which `llmgw ctl logs`
shows. The controller cannot know a node's directories, so the node refuses, and no engine is started.
"""

from __future__ import annotations

import pytest

from llmgw import settings
from llmgw.control.catalog import CatalogError, check_source
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
        check_source("../../etc/shadow")
    with pytest.raises(CatalogError, match="agent.local_sources"):
        check_source("models/m.gguf")
    with pytest.raises(settings.ConfigError, match="agent.local_sources: 'models' must be absolute paths"):
        settings.load(None, {"agent.local_sources": "models"})
