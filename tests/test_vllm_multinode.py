"""A real vLLM over two nodes: two real agents on this machine (each with InfiniBand ports replayed in a sysfs
tree of its own, on one fabric), a real controller placing the starter model's profile with `nodes = 2`
over them, each agent starting its rank of vLLM's CPU build in vLLM's own multi-node mode (rank 0 serving
HTTP, rank 1 headless), and a real gateway serving it once both are up; then rank 1's engine killed, and
the replica taken out of rotation and stopped whole, as a real rank 0 goes on answering /health with a
rank gone (../shared/engines-offline.md).

On a CPU, vLLM's ranks talk over gloo, not NCCL: what this proves is the lifecycle and vLLM's flags, not a
fabric's collectives (nothing here has one). Each node's ranks are pinned to a core of their own
(`VLLM_CPU_OMP_THREADS_BIND`, in each agent's environment): both on core 0 take 35 s for 64 tokens.
"""

from __future__ import annotations

import os
import signal

import openai
import pytest

from llmgw.procs import wait_for
from tests import realvllm
from tests.cluster import Agent, Controller
from tests.conftest import Gateway, make_key
from tests.test_fabric_discovery import FABRIC_ENV, ib_port

NAME = "smol-duo"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        binary = os.path.join(realvllm.environment(), "bin", "vllm")
        folder = realvllm.starter_folder()
    except realvllm.Unavailable as e:
        pytest.fail(f"vLLM's CPU build could not be made ready: {e}")
    tmp = tmp_path_factory.mktemp("vllm-duo")
    store_url = f"sqlite:///{tmp}/cluster.db"
    env = {**realvllm.ENV, "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
    model = {"name": NAME, "source": folder, "max_context": 1024, "max_output": 64, "scaling": {"min": 1, "max": 1},
             # --enforce-eager and -O0 are left out: with a pipeline over two ranks either answers /health, then
             # fails the first request (rank 1: `assert self.intermediate_tensors is not None`); compiled, it
             # is ready in about two minutes here.
             "profiles": [{"engine": "vllm", "nodes": 2, "args": ["--max-num-seqs", "2"], "env": env,
                           "start_limit": 900}]}
    made = []
    try:
        c = Controller(tmp, store_url=store_url, models=[model])
        made.append(c)
        agents = {}
        for core, node_id in enumerate(("n1", "n2")):
            root = tmp / node_id
            ib_port(root, "mlx5_0")
            ib_port(root, "mlx5_1", node_guid="0c42:a103:0045:bd6d", gids=("fe80:0000:0000:0000:0c42:a103:0045:bd6d",))
            agents[node_id] = Agent(tmp, [f"127.0.0.1:{c.agent_port}"], node_id, c.issue_key(node_id),
                                    env={**FABRIC_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core)},
                                    fabrics=[{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"]}],
                                    agent__infiniband_dir=str(root / "sys/class/infiniband"), agent__vllm=binary,
                                    agent__local_sources=[os.path.dirname(folder)])
            made.append(agents[node_id])
        gw = Gateway(tmp, store_url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                     gateway__key_file=c.gateway_key_file())
        made.append(gw)
        wait_for("both ranks of vLLM ready", 900, lambda: len(c.ready(NAME)) == 2, interval=0.5)
        yield c, agents, gw, make_key(store_url)
    finally:
        for thing in reversed(made):
            thing.stop()


def test_vllm_over_two_nodes_answers_and_dies_whole(cluster):
    c, agents, gw, key = cluster
    shards = {r["rank"]: r for r in c.replicas(NAME)}
    assert {shards[0]["node"], shards[1]["node"]} == {"n1", "n2"} and shards[1]["url"] is None
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=300) as client:
        answer = client.chat.completions.create(model=NAME, max_tokens=16,
                                                messages=[{"role": "user", "content": "Say hello."}])
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    # vLLM's own multi-node flags, as the agent gave them.
    follower_log = (agents[shards[1]["node"]].folder / "work" / "shards" / f"{shards[1]['shard_id']}.log").read_text()
    started = follower_log.split("--- llmgw: starting ", 1)[1].splitlines()[0]
    assert "--nnodes 2 --node-rank 1" in started and "--headless" in started and "--port" not in started

    # Rank 1 dies: rank 0 still answers /health, but the replica is out of rotation and stopped whole.
    [pid] = [p for shard, p in agents[shards[1]["node"]].engines().items() if shard == shards[1]["shard_id"]]
    os.killpg(pid, signal.SIGKILL)
    wait_for("rank 0 stopped with its replica", 120,
             lambda: shards[0]["shard_id"] not in agents[shards[0]["node"]].engines())
    assert "rank 1 is gone: a replica over 2 nodes is stopped whole" in c.log()
    wait_for("the replica placed again whole", 60,
             lambda: {r["group"] for r in c.replicas(NAME) if "group" in r} - {shards[0]["group"]})
