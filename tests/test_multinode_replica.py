"""A replica over two nodes, end to end: a real controller places it on the two agents that share a fabric
(their InfiniBand ports replayed in a sysfs tree of their own, their subnet manager by the fake
infiniband-diags), each agent starts its rank (the simulated engine in its rank mode: rank 0 serves HTTP
once the other has joined it, as a real vLLM's does), the gateway serves it once both are ready, and a rank
that dies takes the whole replica out of rotation and has it started again whole. An agent restarted adopts
its rank; nothing is placed again."""

from __future__ import annotations

import os
import signal

import pytest

from llmgw import settings, store
from llmgw.people import accounts, keys
from llmgw.procs import wait_for
from llmgw.web.app import GatewayApp
from tests.cluster import Agent, Controller
from tests.conftest import Gateway, make_key, post
from tests.test_fabric_discovery import FABRIC_ENV, ib_port
from tests.test_pages import sign_in

FABRIC = [{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"], "rate_gbps": 400.0}]
MODEL = {"name": "duo", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
         "profiles": [{"engine": "sim", "nodes": 2, "args": ["--ttft-ms", "5", "--tokens-per-s", "0"]}]}
PASSWORD = "a long enough password"
CHAT = {"model": "duo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


class Cluster:
    """A controller, nodes n1 and n2 on fabric ib-a, n3 on none (it never gets a rank), and a gateway."""

    def __init__(self, tmp, made: list):
        self.store = store = f"sqlite:///{tmp}/cluster.db"
        self.c = Controller(tmp, store_url=store, models=[MODEL])
        made.append(self.c)
        self.agents = {}
        for node_id in ("n1", "n2", "n3"):
            root = tmp / node_id
            if node_id != "n3":
                ib_port(root, "mlx5_0")
                ib_port(root, "mlx5_1", node_guid="0c42:a103:0045:bd6d",
                        gids=("fe80:0000:0000:0000:0c42:a103:0045:bd6d",))
            self.agents[node_id] = Agent(tmp, [f"127.0.0.1:{self.c.agent_port}"], node_id,
                                         self.c.issue_key(node_id), env=FABRIC_ENV,
                                         fabrics=FABRIC if node_id != "n3" else (),
                                         agent__infiniband_dir=str(root / "sys/class/infiniband"),
                                         agent__health_interval=0.5, agent__restart_unhealthy_after=3.0)
            made.append(self.agents[node_id])
        self.key = make_key(store)
        self.gw = Gateway(tmp, store, workers=1, gateway__controller=f"127.0.0.1:{self.c.gateway_port}",
                          gateway__key_file=self.c.gateway_key_file())
        made.append(self.gw)

    def shards(self) -> dict[int, dict]:
        return {r["rank"]: r for r in self.c.replicas("duo") if "rank" in r}

    def serving(self) -> dict[int, dict] | None:
        """The group's ranks, once both are ready and the gateway answers through rank 0."""
        shards = self.shards()
        if len(shards) != 2 or any(r["state"] != "ready" for r in shards.values()):
            return None
        status, _, _ = post(self.gw.url + "/v1/chat/completions", CHAT, key=self.key)
        return shards if status == 200 else None

    def engines_of(self, group: str) -> list[str]:
        return [shard for a in self.agents.values() for shard in a.engines() if shard.startswith(group)]


@pytest.fixture
def cluster(tmp_path):
    made: list = []
    try:
        yield Cluster(tmp_path, made)
    finally:
        for thing in reversed(made):
            thing.stop()


def cluster_page(cluster) -> str:
    """The cluster page as an administrator sees it, from the gateway's pages over the test's store."""
    c = cluster.c
    engine = store.open_store(cluster.store)
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    engine.dispose()
    app = GatewayApp(settings.load(None, {"store.url": cluster.store, "gateway.controller": f"127.0.0.1:{c.gateway_port}",
                                          "gateway.controller_admin": f"127.0.0.1:{c.admin_port}",
                                          "controller.keys_dir": c.values["controller.keys_dir"]}), key_source=keys)
    app.pages.testing = True
    try:
        client = app.pages.test_client()
        sign_in(client, "root@example.org", PASSWORD)
        return client.get("/admin?partial=1").get_data(as_text=True)
    finally:
        app.runtime.engine.dispose()


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)


def test_a_replica_over_two_nodes_serves_lives_and_dies_whole(cluster):
    c = cluster.c
    wait_for("the replica over n1 and n2 serving", 90, cluster.serving)
    shards = cluster.shards()
    leader, follower = shards[0], shards[1]
    assert {leader["node"], follower["node"]} == {"n1", "n2"}
    assert leader["group"] == follower["group"] and leader["shard_id"] == leader["group"] + "-r0"
    assert follower["url"] is None  # headless: nothing for a gateway to reach
    # The rank's engine was given its fabric's adapters, each with its port, and the node's own interface.
    [pid] = [p for shard, p in cluster.agents[follower["node"]].engines().items() if shard == follower["shard_id"]]
    env = environ(pid)
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1" and env["NCCL_IB_DISABLE"] == "0"
    assert env["NCCL_SOCKET_IFNAME"] == "=lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    explained = {row["node"]: row for row in c.api("/api/v1/models/duo/placement")["nodes"]}
    assert "no fabric" in explained["n3"]["reason"]
    # The cluster page names each rank, and `ctl replicas` too.
    page = cluster_page(cluster)
    assert "rank 0 of 2, serves HTTP" in page and "rank 1 of 2, headless" in page
    listed = c.ctl("replicas", "--model", "duo").stdout
    assert "(rank 1 of 2)" in listed

    # The agent of rank 1 restarted: it adopts its rank; the replica goes on, nothing placed again.
    agent = cluster.agents[follower["node"]]
    agent.stop(sig=signal.SIGKILL, engines=False)
    agent.start()
    wait_for("the agent back, its rank adopted", 30, lambda: "adopted shard " + follower["shard_id"] in agent.log())
    assert {r["shard_id"] for r in c.replicas("duo")} == {leader["shard_id"], follower["shard_id"]}

    # Rank 1's engine dies: rank 0 still answers /health, but the replica is out of rotation at once, rank 0
    # stopped, and the replica started again whole.
    os.killpg(pid, signal.SIGKILL)
    wait_for("the old group gone and a new one serving", 90,
             lambda: (s := cluster.serving()) and s[0]["group"] != leader["group"])
    assert "rank 1 is gone: a replica over 2 nodes is stopped whole" in c.log()
    wait_for("the old rank 0 stopped", 60, lambda: not cluster.engines_of(leader["group"]))


def test_a_hung_rank_is_not_restarted_alone_but_its_replica_whole(cluster):
    wait_for("the replica serving", 90, cluster.serving)
    leader = cluster.shards()[0]
    [pid] = [p for shard, p in cluster.agents[leader["node"]].engines().items() if shard == leader["shard_id"]]
    os.killpg(pid, signal.SIGSTOP)  # hung: its /health stops answering
    try:
        wait_for("a new group serving", 120,
                 lambda: (s := cluster.serving()) and s[0]["group"] != leader["group"])
    finally:
        try:
            os.killpg(pid, signal.SIGCONT)
        except OSError:
            pass
    log = cluster.agents[leader["node"]].log()
    assert "a rank of a replica over several nodes is not restarted alone" in log
    assert f"restarting shard {leader['shard_id']}" not in log
    wait_for("the old group's ranks stopped", 60, lambda: not cluster.engines_of(leader["group"]))
