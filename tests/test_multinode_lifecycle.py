"""A replica over several nodes through the reconciler: placed whole, rank 0 started first and the others once
it says where they meet, served only once every rank is ready, counted as one replica, and stopped whole
when any rank fails, stops or is lost; a restarted controller takes a group back only whole."""

import dataclasses

import pytest

from llmgw.control import placement, seals
from llmgw.control.catalog import Model, Profile
from llmgw.control.fleet import LOST, NodeView, node_facts
from llmgw.control.reconciler import Replicas, Start, Stop, plan, start_message, units, whole
from tests.test_multinode_placement import A, fabric


def node(node_id, state="ready", fabrics=None):
    cards = [{"index": i, "class": "h100-80g", "health": "ok"} for i in range(8)]
    registration = {"gpus": cards, "engines": {"vllm": "0.32.0", "sim": "1"}, "engines_probed": True,
                    "memory": {"total_bytes": 1 << 40},
                    "fabrics": [fabric(A)] if fabrics is None else fabrics}
    return NodeView(node_id, state, 0.0, 0.0, node_facts(registration, {}))


def big(low=1, high=1):
    return Model(name="big", source="/m", min_replicas=low, max_replicas=high,
                 profiles=(Profile(name="two-nodes", engine="vllm", gpus=8, nodes=2,
                                   env=(("NCCL_DEBUG", "WARN"),)),))


def status(replicas, shard_id, state, **more):
    r = replicas.items[shard_id]
    return replicas.report(r.node_id, {"shard_id": shard_id, "state": state, "model": r.model, **more}, now=0.0)


def started(models, nodes, replicas, now=0.0):
    """Place one group and bring it to ready; returns (rank 0's id, rank 1's id)."""
    actions, _ = plan(models, nodes, replicas, now=now)
    [first] = actions
    second = next(r.shard_id for r in replicas.items.values() if r.group == first.group and r.rank == 1)
    status(replicas, first.shard_id, "starting", master="10.0.0.1:29500")
    [then] = plan(models, nodes, replicas, now=now + 1)[0]
    assert then.shard_id == second
    status(replicas, second, "ready")
    status(replicas, first.shard_id, "ready", url="http://10.0.0.1:8000")
    return first.shard_id, second


def test_rank_0_starts_first_and_the_others_once_it_says_where_they_meet():
    models, nodes, replicas = {"big": big()}, [node("a"), node("b")], Replicas()
    actions, unplaced = plan(models, nodes, replicas, now=0.0)
    assert unplaced == {}
    [first] = actions
    assert isinstance(first, Start) and first.rank == 0 and first.ranks == 2 and first.decision.node_id == "a"
    message = start_message(models["big"], first)
    assert message["group"] == first.group and message["rank"] == 0 and message["ranks"] == 2
    assert "master" not in message
    # The fabric it was placed on and the node's adapters there (the node sets NCCL's variables from them);
    # the storage network's adapter is not among them.
    assert message["fabric"] == A and message["adapters"] == ["mlx5_0", "mlx5_1"]
    assert message["env"] == {"NCCL_DEBUG": "WARN"}
    waiting = [r for r in replicas.items.values() if r.rank == 1]
    assert [r.state for r in waiting] == ["waiting"] and waiting[0].node_id == "b"
    # The waiting rank holds its node's cards already: nothing else is given them meanwhile.
    assert any(c.node_id == "b" and c.gpus == tuple(range(8)) for c in replicas.claims())
    assert plan(models, nodes, replicas, now=1.0)[0] == []  # rank 0 has not said where they meet
    status(replicas, first.shard_id, "starting", master="10.0.0.1:29500")
    [second] = plan(models, nodes, replicas, now=2.0)[0]
    assert second.rank == 1 and second.decision.node_id == "b" and second.master == "10.0.0.1:29500"
    assert start_message(models["big"], second)["master"] == "10.0.0.1:29500"
    assert plan(models, nodes, replicas, now=3.0)[0] == []  # sent once


def test_a_group_serves_only_once_every_rank_is_ready_and_counts_as_one_replica():
    models, nodes, replicas = {"big": big()}, [node("a"), node("b"), node("c"), node("d")], Replicas()
    actions, _ = plan(models, nodes, replicas, now=0.0)
    [first] = actions
    status(replicas, first.shard_id, "starting", master="10.0.0.1:29500")
    plan(models, nodes, replicas, now=1.0)
    status(replicas, first.shard_id, "ready", url="http://10.0.0.1:8000")
    assert [r.state for r in whole(replicas.snapshot())] == ["pending"]  # rank 1 is not ready yet
    second = next(r.shard_id for r in replicas.items.values() if r.rank == 1)
    status(replicas, second, "ready")
    [serving] = whole(replicas.snapshot())
    assert serving.shard_id == first.shard_id and serving.state == "ready" and serving.url == "http://10.0.0.1:8000"
    assert plan(models, nodes, replicas, now=2.0)[0] == []  # one replica wanted, one running: two shards


def test_a_rank_that_fails_stops_the_whole_group_and_the_model_backs_off():
    models, nodes, replicas = {"big": big()}, [node("a"), node("b")], Replicas(base_backoff=10.0)
    first, second = started(models, nodes, replicas)
    status(replicas, second, "failed", detail="the engine exited with status 1", last_output=["boom"])
    actions, _ = plan(models, nodes, replicas, now=5.0)
    [stop] = actions
    assert isinstance(stop, Stop) and stop.shard_id == first
    assert stop.reason == "rank 1 is gone: a replica over 2 nodes is stopped whole"
    assert whole(replicas.snapshot()) == []  # out of every gateway's rotation at once
    assert replicas.failures["big"].last_output == ["boom"]
    status(replicas, first, "stopped")
    assert plan(models, nodes, replicas, now=6.0)[0] == []  # backing off
    [again] = plan(models, nodes, replicas, now=11.0)[0]
    assert again.rank == 0 and again.group != replicas.failures["big"].shard_id


def test_a_lost_node_stops_the_rest_of_its_group_and_its_rank_is_stopped_when_it_comes_back():
    models, replicas = {"big": big()}, Replicas()
    first, second = started(models, [node("a"), node("b")], replicas)
    actions, _ = plan(models, [node("a"), node("b", state=LOST), node("c")], replicas, now=5.0)
    stops = [a for a in actions if isinstance(a, Stop)]
    assert [s.shard_id for s in stops] == [first]
    assert stops[0].reason == "rank 1's node b is lost: a replica over 2 nodes is stopped whole"
    assert second not in replicas.items and replicas.retired[second] == "b"
    # b comes back still running its rank: it is stopped.
    replicas.registered("b", [{"shard_id": second, "state": "ready", "model": "big", "group": "g", "rank": 1,
                               "ranks": 2}], now=6.0)
    assert [o.shard_id for o in replicas.orders] == [second]


def test_stopping_one_rank_stops_them_all_and_a_drain_moves_the_group_whole():
    models, replicas = {"big": big()}, Replicas()
    nodes = [node("a"), node("b"), node("c"), node("d")]
    first, second = started(models, nodes, replicas)
    draining = [node("a"), dataclasses.replace(node("b"), state="draining"), node("c"), node("d")]
    # A replacement first (one replica is wanted; the group on b is leaving), on the two nodes not draining.
    [new] = plan(models, draining, replicas, now=5.0)[0]
    assert {r.node_id for r in replicas.items.values() if r.group == new.group} == {"c", "d"}
    status(replicas, new.shard_id, "starting", master="10.0.0.3:29500")
    plan(models, draining, replicas, now=6.0)
    assert all(replicas.items[s].state != "stopping" for s in (first, second))  # kept while the new one starts
    for r in [r for r in replicas.items.values() if r.group == new.group]:
        status(replicas, r.shard_id, "ready", **({"url": "http://10.0.0.3:8000"} if r.rank == 0 else {}))
    # The new one ready, the old one goes: rank 0 first, drained of the requests it has (they need rank 1);
    # rank 1 once rank 0 has stopped.
    [stop] = plan(models, draining, replicas, now=7.0)[0]
    assert stop.shard_id == first and stop.reason == "b is draining"
    assert plan(models, draining, replicas, now=8.0)[0] == []
    status(replicas, first, "stopped")
    [stop] = plan(models, draining, replicas, now=9.0)[0]
    assert stop.shard_id == second


def test_a_group_whose_ranks_are_not_all_back_is_waited_for_while_nodes_may_bring_theirs():
    models, nodes = {"big": big()}, [node("a"), node("b")]
    replicas = Replicas()
    replicas.registered("a", [{"shard_id": "big-1-r0", "state": "ready", "model": "big", "group": "big-1",
                               "rank": 0, "ranks": 2, "url": "http://10.0.0.1:8000"}], now=0.0)
    assert plan(models, nodes, replicas, now=1.0, adopting=True)[0] == []  # b may be late
    assert whole(replicas.snapshot()) == []  # but not served meanwhile
    replicas.registered("b", [{"shard_id": "big-1-r1", "state": "ready", "model": "big", "group": "big-1",
                               "rank": 1, "ranks": 2}], now=2.0)
    assert plan(models, nodes, replicas, now=3.0, adopting=True)[0] == []
    assert [r.shard_id for r in whole(replicas.snapshot())] == ["big-1-r0"]


def test_a_waiting_rank_on_a_lost_node_is_forgotten_not_retired():
    models, replicas = {"big": big()}, Replicas()
    [first] = plan(models, [node("a"), node("b")], replicas, now=0.0)[0]
    waiting = next(r.shard_id for r in replicas.items.values() if r.rank == 1)
    actions, _ = plan(models, [node("a"), node("b", state=LOST)], replicas, now=1.0)
    assert [a.shard_id for a in actions if isinstance(a, Stop)] == [first.shard_id]
    assert waiting not in replicas.items and waiting not in replicas.retired


def test_a_single_replica_named_like_a_group_is_not_taken_into_it():
    replicas = Replicas()
    replicas.registered("a", [{"shard_id": "big-1-r0", "state": "ready", "model": "big", "group": "big-1",
                               "rank": 0, "ranks": 2}], now=0.0)
    replicas.registered("c", [{"shard_id": "big-1", "state": "ready", "model": "big"}], now=0.0)
    assert sorted(len(u.members) for u in units(replicas.snapshot())) == [1, 1]


def test_a_rank_is_sealed_to_its_node():
    key = seals.key_of(b"the controller's secret")
    models, replicas = {"big": big()}, Replicas(seal_key=key)
    [first] = plan(models, [node("a"), node("b")], replicas, now=0.0)[0]
    message = start_message(models["big"], first)
    shard = {"shard_id": first.shard_id, "model": "big", "group": first.group, "rank": 0, "ranks": 2,
             "seal": message["seal"]}
    assert seals.holds(key, "a", shard)
    assert not seals.holds(key, "c", shard)  # another node's claim to it
    assert not seals.holds(key, "a", {**shard, "rank": 1})
    assert not seals.holds(seals.key_of(b"another controller"), "a", shard)
    assert not seals.holds(key, "a", {k: v for k, v in shard.items() if k != "seal"})


def test_a_restarted_controller_takes_a_group_back_only_whole():
    models, nodes = {"big": big()}, [node("a"), node("b")]
    shard = {"state": "ready", "model": "big", "engine": "vllm", "group": "big-1", "ranks": 2, "gpus": list(range(8))}
    replicas = Replicas()
    replicas.registered("a", [{**shard, "shard_id": "big-1-r0", "rank": 0, "url": "http://10.0.0.1:8000",
                               "master": "10.0.0.1:29500"}], now=0.0)
    replicas.registered("b", [{**shard, "shard_id": "big-1-r1", "rank": 1}], now=0.0)
    assert plan(models, nodes, replicas, now=1.0)[0] == []
    assert [r.shard_id for r in whole(replicas.snapshot())] == ["big-1-r0"]
    # Only rank 0 came back (b's agent lost its rank meanwhile): the rank left alone is stopped, and a new
    # group placed.
    replicas = Replicas()
    replicas.registered("a", [{**shard, "shard_id": "big-1-r0", "rank": 0, "url": "http://10.0.0.1:8000"}], now=0.0)
    actions, _ = plan(models, nodes, replicas, now=1.0)
    assert [type(a) for a in actions] == [Stop, Start] and actions[0].shard_id == "big-1-r0"


def test_a_node_without_the_fabric_is_not_given_a_rank():
    models = {"big": big()}
    actions, unplaced = plan(models, [node("a"), node("b", fabrics=[])], Replicas(), now=0.0)
    assert actions == [] and "it has no fabric" in unplaced["big"]["b"]
    assert placement.place(models["big"], [node("a"), node("b")], [])[0] is not None


def test_ranks_on_two_machines_speak_for_themselves_and_a_borrowed_seal_is_refused():
    # Two nodes on two addresses: the follower reports no master (rank 0's address would not be its own),
    # and each rank is taken, on adoption, only with its own seal.
    from llmgw.control.claims import ShardClaims
    from llmgw.control.fleet import Fleet
    from llmgw.node.supervisor import Shard, Supervisor

    key = seals.key_of(b"the controller's secret")
    fleet = Fleet(10.0, 60.0)
    for node_id, address in (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")):
        fleet.register(node_id, {"engines": {"vllm": "0.32.0"}, "engines_probed": True,
                                 "gpus": [{"index": i, "class": "h100-80g", "health": "ok"} for i in range(8)]},
                       b"identity", now=0.0, peer=address)
    models = {"big": big()}
    claims = ShardClaims(fleet, Replicas(seal_key=key), lambda: models)
    statuses = {}
    for rank, (node_id, address) in enumerate((("a", "10.0.0.1"), ("b", "10.0.0.2"))):
        supervisor = Supervisor.__new__(Supervisor)
        supervisor.node_id, supervisor.url_host = node_id, address
        spec = {"shard_id": f"big-1-r{rank}", "model": "big", "engine": "vllm", "gpus": list(range(8)),
                "group": "big-1", "rank": rank, "ranks": 2, "seal": seals.seal(key, node_id, "big", "big-1", rank, 2),
                "profile_fp": models["big"].fingerprint(models["big"].profiles[0]),
                **({"master": "10.0.0.1:29500"} if rank else {})}
        shard = Shard(spec, 8000 if rank == 0 else None, "/dev/null", "k")
        shard.master_port, shard.state = 29500, "ready"
        statuses[node_id] = supervisor.status(shard)
    assert statuses["a"]["master"] == "10.0.0.1:29500" and "master" not in statuses["b"]
    assert "url" not in statuses["b"] and "api_key" not in statuses["b"]
    assert claims.judge("a", statuses["a"], now=1.0, adopting=True) is None
    assert claims.judge("b", statuses["b"], now=1.0, adopting=True) is None
    # c, whose key leaked, claims b's rank (with b's seal, or none) before b is back: refused.
    stolen = {**statuses["b"], "node_id": "c"}
    assert "does not carry the seal of rank 1 of big-1 on c" in claims.judge("c", stolen, now=1.0, adopting=True)
    unsealed = {k: v for k, v in stolen.items() if k != "seal"}
    assert "does not carry the seal" in claims.judge("c", unsealed, now=1.0, adopting=True)
    # A rank named without its rank, or a master on another machine.
    assert "does not read as rank" in claims.judge("c", {**stolen, "shard_id": "big-1-rNone", "rank": None},
                                                   now=1.0, adopting=True)
    assert "is not on the node's own address" in claims.judge("c", {**stolen, "master": "10.0.0.1:29500"},
                                                               now=1.0, adopting=True)
    # Sealed, but of a replica over three nodes, which no profile of the model is.
    three = {**statuses["a"], "ranks": 3, "seal": seals.seal(key, "a", "big", "big-1", 0, 3)}
    assert "has no profile for engine 'vllm' over 3 nodes" in claims.judge("a", three, now=1.0, adopting=True)


def test_a_rank_whose_adapters_are_all_down_fails_rather_than_fall_back_to_sockets():
    from llmgw.node.supervisor import Shard, Supervisor

    supervisor = Supervisor.__new__(Supervisor)
    supervisor.url_host = "10.0.0.1"
    ports = [{"hca": "mlx5_0", "port": 1, "state": "ACTIVE"}, {"hca": "mlx5_1", "port": 1, "state": "DOWN"}]
    supervisor.ports = lambda: ports
    spec = {"shard_id": "big-1-r0", "model": "big", "engine": "vllm", "group": "big-1", "rank": 0, "ranks": 2,
            "fabric": A, "adapters": ["mlx5_0", "mlx5_1"]}
    env = supervisor._fabric_environment(Shard(spec, 8000, "/dev/null", "k"))
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1"  # the port that is down now is left out
    ports[0]["state"] = "DOWN"
    with pytest.raises(ValueError, match=r"none of the adapters its replica was placed on \(mlx5_0, mlx5_1\)"):
        supervisor._fabric_environment(Shard(spec, 8000, "/dev/null", "k"))
