"""Placing a replica over several nodes (llmgw/control/multinode.py): only nodes sharing one physical
fabric or one multi-node NVLink domain, never across them, degraded nodes last; by example and by
property."""

import dataclasses
import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.control import catalog, placement
from llmgw.control.catalog import Model, Profile
from llmgw.control.fleet import NodeView, node_facts

A, B = "sm:0x00000000000000aa", "sm:0x00000000000000bb"
DOMAIN = "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa/32766"


def node(node_id, fabrics=(), gpus=8, domain=None, imex=None, state="ready"):
    cards = [{"index": i, "class": "h100-80g", "health": "ok", "nic_paths": {"mlx5_0": "PIX" if i < 4 else "SYS",
                                                                              "mlx5_1": "SYS" if i < 4 else "PIX"},
              **({"nvlink_domain": domain} if domain is not None else {})} for i in range(gpus)]
    registration = {"gpus": cards, "engines": {"vllm": "0.32.0", "sim": "1"}, "engines_probed": True,
                    "memory": {"total_bytes": 1 << 40}, "fabrics": list(fabrics),
                    **({"imex": {"state": imex}} if imex else {})}
    return NodeView(node_id, state, 0.0, 0.0, node_facts(registration, {}))


def fabric(physical, name="ib-a", adapters=("mlx5_0", "mlx5_1"), rate=400.0, degraded=""):
    return {"name": name, "physical": physical, "adapters": list(adapters), "rate_gbps": rate,
            **({"degraded": degraded} if degraded else {})}


def big(nodes=2, gpus=8):
    return Model(name="big", source="/m", profiles=(Profile(name="tp8pp2", engine="vllm", gpus=gpus, nodes=nodes),))


def over(model, nodes, claims=()):
    profile = model.profiles[0]
    return placement.over_nodes(model, profile, nodes, placement._by_node(list(claims)))


def test_a_replica_goes_on_nodes_of_one_physical_fabric_never_two():
    # c calls its fabric ib-a too, but its adapters see other subnet managers: it is another fabric.
    nodes = [node("a", [fabric(A)]), node("b", [fabric(A)]), node("c", [fabric(B)]), node("d")]
    group, reasons = over(big(), nodes)
    assert [r.node_id for r in group.ranks] == ["a", "b"] and group.island.key == A
    assert group.ranks[0].adapters == ("mlx5_0", "mlx5_1") and group.ranks[0].gpus == tuple(range(8))
    assert "it has no fabric" in reasons["d"]
    # Three nodes: no fabric has three, and each fabric says how many of its nodes could.
    group, reasons = over(big(nodes=3), nodes)
    assert group is None
    assert reasons[f"ib-a ({A})"] == "2 of its nodes can take a shard (a, b), 3 needed"
    assert reasons[f"ib-a ({B})"] == "1 of its nodes can take a shard (c), 3 needed"


def test_a_shards_cards_are_near_its_adapters_and_held_cards_are_not_given():
    nodes = [node("a", [fabric(A, adapters=("mlx5_1",))]), node("b", [fabric(A, adapters=("mlx5_0",))])]
    group, _ = over(big(gpus=4), nodes)
    by_node = {r.node_id: r.gpus for r in group.ranks}
    assert by_node == {"a": (4, 5, 6, 7), "b": (0, 1, 2, 3)}
    held = [placement.Claim("a", "other", 0, (4, 5, 6, 7))]
    group, reasons = over(big(gpus=6), nodes, held)
    assert group is None and reasons["a"].startswith("needs 6 x any GPU, 4 free of 8")


def test_nodes_with_a_degraded_cable_come_last():
    nodes = [node("a", [fabric(A, degraded="mlx5_1/1 at 200 Gb/s of 400")]), node("b", [fabric(A)]), node("c", [fabric(A)])]
    group, _ = over(big(), nodes)
    assert sorted(r.node_id for r in group.ranks) == ["b", "c"]


def test_a_multi_node_nvlink_domain_is_preferred_and_needs_imex():
    nodes = [node("a", [fabric(A)], domain=DOMAIN, imex="active"), node("b", [fabric(A)], domain=DOMAIN, imex="active"),
             node("c", [fabric(A)])]
    group, _ = over(big(), nodes)
    assert group.island.key == f"nvl:{DOMAIN}" and [r.node_id for r in group.ranks] == ["a", "b"]
    # Without IMEX the cards cannot share memory across nodes: the InfiniBand fabric is used instead.
    nodes[1] = node("b", [fabric(A)], domain=DOMAIN, imex="failed")
    group, _ = over(big(), nodes)
    assert group.island.key == A


def test_a_fabric_not_yet_verified_is_kept_apart_from_one_that_is():
    nodes = [node("a", [fabric("")]), node("b", [fabric(A)])]
    group, reasons = over(big(), nodes)
    assert group is None and "unverified:ib-a" in " ".join(reasons)
    group, _ = over(big(), [node("a", [fabric("")]), node("b", [fabric("")])])
    assert group.island.key == "unverified:ib-a"


def test_placement_gives_the_nodes_rank_0_first_and_explains_them():
    nodes = [node("a", [fabric(A)]), node("b", [fabric(A)])]
    decision, _ = placement.place(big(), nodes, [])
    assert [r.node_id for r in decision.ranks] == ["a", "b"] and decision.island.name == "ib-a"
    rows = {r["node"]: r for r in placement.explain(big(), nodes + [node("d")], [])}
    assert rows["a"]["fits"] and rows["a"]["reason"].endswith("rank 0 of 2 on ib-a (serves HTTP)")
    assert rows["b"]["reason"].endswith("rank 1 of 2 on ib-a")
    assert not rows["d"]["fits"] and "no fabric" in rows["d"]["reason"]


def test_the_catalog_takes_nodes_and_a_single_node_profile_keeps_its_fingerprint():
    table = {"name": "big", "source": "/m", "profiles": [{"engine": "vllm", "gpus": 8, "nodes": 2}]}
    assert catalog.parse_model(table).profiles[0].nodes == 2
    for bad, words in [({"engine": "vllm", "nodes": 0}, "nodes is how many nodes"),
                       ({"engine": "vllm", "nodes": 65}, "nodes is how many nodes"),
                       ({"engine": "llamacpp", "nodes": 2}, "runs on vLLM")]:
        with pytest.raises(catalog.CatalogError, match=words):
            catalog.parse_model({**table, "profiles": [bad]})
    # The fingerprint of a profile on one node is what it was before `nodes` existed: no replica turns stale.
    model = catalog.parse_model({**table, "profiles": [{"engine": "vllm", "gpus": 1}]})
    profile = model.profiles[0]
    before = {k: v for k, v in dataclasses.asdict(profile).items() if k not in ("start_limit", "nodes")}
    expected = hashlib.sha256(json.dumps([model.source, model.max_context, before], sort_keys=True).encode()).hexdigest()[:12]
    assert model.fingerprint(profile) == expected


@st.composite
def clusters(draw):
    count = draw(st.integers(1, 7))
    nodes = []
    for i in range(count):
        fabrics = draw(st.lists(st.sampled_from([fabric(A), fabric(B, name="ib-b"), fabric("", name="ib-c"),
                                                 fabric(A, degraded="slow"), fabric(A, name="ib-a2")]),
                                max_size=3, unique_by=lambda f: f["name"]))
        domain = draw(st.sampled_from([None, DOMAIN]))
        nodes.append(node(f"n{i}", fabrics, gpus=draw(st.integers(0, 4)), domain=domain,
                          imex=draw(st.sampled_from([None, "active"])),
                          state=draw(st.sampled_from(["ready", "ready", "cordoned"]))))
    return nodes, draw(st.integers(2, 4)), draw(st.integers(0, 2))


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_never_across_islands_never_a_node_twice(case):
    from llmgw.control import multinode

    nodes, count, gpus = case
    group, _ = over(big(nodes=count, gpus=gpus), nodes)
    if group is None:
        return
    ids = [r.node_id for r in group.ranks]
    assert len(ids) == count and len(set(ids)) == count
    by_id = {n.node_id: n for n in nodes}
    for rank in group.ranks:
        member = by_id[rank.node_id]
        assert member.state == "ready" and len(rank.gpus) == gpus
        assert group.island.key in {island.key for island, _, _ in multinode.islands_of(member)}


def test_the_fabrics_view_groups_nodes_by_physical_fabric_whatever_they_call_it():
    from llmgw.control import fabricview

    managers = [{"guid": "0x00000000000000aa", "state": "master"}, {"guid": "0x00000000000000cc", "state": "standby"}]
    port = {"hca": "mlx5_0", "port": 1, "state": "ACTIVE", "fabric_id": A, "subnet_managers": managers}
    a = NodeView("a", "ready", 0, 0, node_facts({"fabrics": [fabric(A)], "ib_ports": [port]}, {}))
    b = NodeView("b", "ready", 0, 0, node_facts({"fabrics": [fabric(A, name="east")]}, {}))
    c = NodeView("c", "ready", 0, 0, node_facts({"fabrics": [fabric(B, degraded="mlx5_1/1 at 200 Gb/s of 400")],
                                                 "fabric_problems": ["fabric ib-z: no port of mlx5_3 is active"]}, {}))
    d = NodeView("d", "ready", 0, 0, node_facts({"fabrics": [fabric("")]}, {}))
    found = fabricview.fabrics([c, b, a, d])
    assert [f["id"] for f in found] == [A, B, "unverified:ib-a"]  # by names, the unverified last
    on_a = found[0]
    assert on_a["names"] == ["east", "ib-a"] and [n["node"] for n in on_a["nodes"]] == ["a", "b"]
    assert on_a["subnet_managers"] == managers and on_a["standby"] == 1
    assert found[1]["nodes"][0]["degraded"] == "mlx5_1/1 at 200 Gb/s of 400" and not found[2]["verified"]
    assert fabricview.problems([a, c]) == [{"node": "c", "problem": "fabric ib-z: no port of mlx5_3 is active"}]


def test_the_nvlink_view_lists_each_domain_its_cards_and_imex():
    from llmgw.control import fabricview

    e = node("e", domain=DOMAIN, imex="active", gpus=4)
    f = NodeView("f", "ready", 0, 0, node_facts({"gpus": [{"index": 0, "nvlink_domain": DOMAIN}, {"index": 1}],
                                                 "imex": {"state": "inactive"}}, {}))
    [domain] = fabricview.nvlink([f, e, node("g")])
    assert domain["domain"] == DOMAIN and [n["node"] for n in domain["nodes"]] == ["e", "f"]
    assert domain["nodes"][1]["not_joined"] == [1] and domain["nodes"][1]["imex"] == "inactive"
    assert domain["usable"] == ["e"]


LEAF_1, LEAF_2 = "0x7cfe900300a1b2c3", "0x7cfe900300a1b2c4"


def test_the_fabric_map_names_each_adapters_leaf():
    from llmgw.control import fabricmaps
    from tests.test_fabric_discovery import fixture

    mapped = fabricmaps.parse(fixture("ibnetdiscover-two-leaves.txt"))
    assert sorted(mapped["switches"]) == [LEAF_1, LEAF_2, "0x7cfe900300d4e5f6"]
    assert mapped["switches"][LEAF_1]["hosts"] == ["0x0c42a1030045bd6c", "0x0c42a1030045bd7c"]
    assert mapped["switches"]["0x7cfe900300d4e5f6"]["hosts"] == []  # the spine
    assert {g: h["leaf"] for g, h in mapped["hosts"].items()} == {
        "0x0c42a1030045bd6c": LEAF_1, "0x0c42a1030045bd7c": LEAF_1,
        "0x0c42a1030045bd8c": LEAF_2, "0x0c42a1030045bd9c": LEAF_2}
    assert mapped["hosts"]["0x0c42a1030045bd9c"]["description"] == "gpu-04 mlx5_0"
    with pytest.raises(ValueError, match="names no switch"):
        fabricmaps.parse("ibwarn: [1234] mad_rpc_open_port: can't open UMAD port\n")


def test_the_controller_maps_each_fabric_through_one_node_and_keeps_why_not():
    from llmgw.control import fabricmaps
    from tests.test_fabric_discovery import fixture

    def scanning(node_id, guid, features=("fabric-scan",)):
        port = {"hca": "mlx5_0", "port": 1, "state": "ACTIVE", "fabric_id": A, "node_guid": guid}
        return NodeView(node_id, "ready", 0, 0, node_facts({"ib_ports": [port], "features": list(features),
                                                            "fabrics": [fabric(A)]}, {}))

    asked = []
    answers = iter([{"output": fixture("ibnetdiscover-two-leaves.txt")}, {"error": "ibnetdiscover failed: x"}, None])

    def ask(node_id, kind, fields, timeout):
        asked.append((node_id, kind, fields))
        return next(answers)

    clock = [1000.0]
    maps = fabricmaps.Maps()
    nodes = [scanning("old", "0x01", features=()), scanning("gpu-01", "0x0c42a1030045bd6c")]
    maps.scan(nodes, ask, now=lambda: clock[0])
    assert asked == [("gpu-01", "scan_fabric", {"hca": "mlx5_0", "port": 1})]  # the old agent is not asked
    assert maps.leaves()[A]["0x0c42a1030045bd8c"] == LEAF_2
    # A port's own say does not get a fabric scanned: only a fabric some node declares and uses.
    stray = scanning("stray", "0x02")
    stray.facts.ib_ports[0]["fabric_id"] = "sm:0x00000000000000ee"
    assert fabricmaps._scanners(nodes + [stray]) == {A: ("gpu-01", "mlx5_0", 1)}
    maps.scan(nodes, ask, now=lambda: clock[0] + 10)
    assert len(asked) == 1  # mapped ten seconds ago: not due
    clock[0] += fabricmaps.SCAN_EVERY
    maps.scan(nodes, ask, now=lambda: clock[0])
    assert maps.get(A)["error"] == "gpu-01: ibnetdiscover failed: x" and maps.leaves() == {}
    maps.scan(nodes, ask, fabric_id=A, now=lambda: clock[0])
    assert maps.get(A)["error"] == "gpu-01 did not answer a scan within 150 s"


def test_two_asking_for_one_fabrics_map_at_once_get_one_scan():
    import threading

    from llmgw.control import fabricmaps
    from tests.test_fabric_discovery import fixture

    port = {"hca": "mlx5_0", "port": 1, "state": "ACTIVE", "fabric_id": A, "node_guid": "0x0c42a1030045bd6c"}
    nodes = [NodeView("gpu-01", "ready", 0, 0, node_facts({"ib_ports": [port], "features": ["fabric-scan"],
                                                           "fabrics": [fabric(A)]}, {}))]
    asked, release = [], threading.Event()

    def ask(node_id, kind, fields, timeout):
        asked.append(node_id)
        release.wait(30)  # ibnetdiscover takes its time
        return {"output": fixture("ibnetdiscover-two-leaves.txt")}

    maps = fabricmaps.Maps()
    first = threading.Thread(target=maps.scan, args=(nodes, ask), kwargs={"fabric_id": A})
    first.start()
    while not asked:
        release.wait(0.01)
    second = threading.Thread(target=maps.scan, args=(nodes, ask), kwargs={"fabric_id": A})
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waiting for the first one's map, not scanning beside it
    release.set()
    first.join(10)
    second.join(10)
    assert asked == ["gpu-01"] and "map" in maps.get(A)


def test_nodes_under_one_leaf_are_taken_together():
    def on_leaf(node_id, guid, replicas_here=0):
        port = {"hca": "mlx5_0", "port": 1, "state": "ACTIVE", "node_guid": guid}
        registration = {"gpus": [], "engines": {"vllm": "1"}, "engines_probed": True, "memory": {"total_bytes": 1 << 40},
                        "fabrics": [fabric(A, adapters=("mlx5_0",))], "ib_ports": [port]}
        return NodeView(node_id, "ready", 0, 0, node_facts(registration, {}))

    # By spread alone a and c come first (b and d run a replica of the model already); a and c are under
    # different leaves, and b is under a's.
    nodes = [on_leaf("a", "0x0c42a1030045bd6c"), on_leaf("b", "0x0c42a1030045bd7c"),
             on_leaf("c", "0x0c42a1030045bd8c"), on_leaf("d", "0x0c42a1030045bd9c")]
    held = [placement.Claim("b", "big", 0, ()), placement.Claim("d", "big", 0, ())]
    model = big(gpus=0)
    group, _ = over(model, nodes, held)
    assert [r.node_id for r in group.ranks] == ["a", "c"]
    leaves = {A: {"0x0c42a1030045bd6c": LEAF_1, "0x0c42a1030045bd7c": LEAF_1,
                  "0x0c42a1030045bd8c": LEAF_2, "0x0c42a1030045bd9c": LEAF_2}}
    group, _ = placement.over_nodes(model, model.profiles[0], nodes, placement._by_node(held), leaves)
    assert [r.node_id for r in group.ranks] == ["a", "b"]
    # Another fabric's map says nothing of this one.
    group, _ = placement.over_nodes(model, model.profiles[0], nodes, placement._by_node(held), {B: leaves[A]})
    assert [r.node_id for r in group.ranks] == ["a", "c"]


def test_odd_peers_a_node_reports_are_left_out_not_fatal():
    # "²" passes str.isdigit() and fails int(): once, one heartbeat so took every node's view down.
    facts = node_facts({"gpus": [{"index": 0, "nvlink": {"²": 4, "1": 2, "0": 3, "99999": 1}}, {"index": 1}]}, {})
    assert facts.gpus[0].nvlink == {1: 2}


def test_nodes_cabled_crosswise_do_not_share_their_leaves():
    from llmgw.control import multinode

    def cabled(node_id, first, second):
        ports = [{"hca": "mlx5_0", "port": 1, "node_guid": first}, {"hca": "mlx5_1", "port": 1, "node_guid": second}]
        return NodeView(node_id, "ready", 0, 0, node_facts({"ib_ports": ports}, {}))

    leaves = {"0x01": LEAF_1, "0x02": LEAF_2, "0x03": LEAF_1, "0x04": LEAF_2, "0x05": LEAF_2, "0x06": LEAF_1}
    rails = ("mlx5_0", "mlx5_1")
    straight = [multinode.leaf_key(cabled(n, a, b), rails, leaves) for n, a, b in (("a", "0x01", "0x02"),
                                                                                    ("b", "0x03", "0x04"))]
    crosswise = multinode.leaf_key(cabled("c", "0x05", "0x06"), rails, leaves)
    assert straight[0] == straight[1] != crosswise
    assert multinode.leaf_key(cabled("d", "0x01", "0x99"), rails, leaves) is None  # one leaf not known
