"""The cluster's fabrics and NVLink domains as operators read them, from what the nodes last said.

A fabric is a physical one (llmgw/node/fabrics.py: the lowest GUID of its subnet managers, or a RoCE
network), whatever each node calls it, so two physical fabrics given one name show as two, and one
fabric named differently on two nodes shows its names. A fabric a node could not verify yet stands apart
under `unverified:<name>`. For each: the names it is declared under, its subnet managers as a port saw
them, and its nodes with their adapters, rate and degraded ports; and every declared fabric a node cannot
use, with its reason. An NVLink domain lists its nodes, each card's fabric state and the node's IMEX.
"""

from __future__ import annotations

import json

from llmgw.control.fleet import NodeView


def managers(nodes: list[NodeView]) -> dict[str, list[dict]]:
    """Each InfiniBand fabric's subnet managers, as most of the nodes that list them say: one node (whose key
    leaked, say) cannot hide a fabric's missing standby by saying otherwise first."""
    said: dict[str, dict[str, tuple[int, list[dict]]]] = {}
    for node in nodes:
        for port in node.facts.ib_ports:
            fabric, listed = port.get("fabric_id"), port.get("subnet_managers")
            if fabric and isinstance(listed, list):
                key = json.dumps(listed, sort_keys=True)
                count, _ = said.setdefault(fabric, {}).get(key, (0, listed))
                said[fabric][key] = (count + 1, listed)
    return {fabric: max(versions.items(), key=lambda item: (item[1][0], item[0]))[1][1]
            for fabric, versions in said.items()}


def fabrics(nodes: list[NodeView]) -> list[dict]:
    """Every physical fabric the nodes report, by identity; its nodes in name order."""
    found: dict[str, dict] = {}
    listed = managers(nodes)
    for node in nodes:
        for fabric in node.facts.fabrics:
            key = fabric.get("physical") or f"unverified:{fabric['name']}"
            entry = found.setdefault(key, {"id": key, "verified": bool(fabric.get("physical")), "names": [],
                                           "link_layer": fabric.get("link_layer", ""), "subnet_managers": [],
                                           "nodes": []})
            if fabric["name"] not in entry["names"]:
                entry["names"].append(fabric["name"])
            entry["subnet_managers"] = listed.get(key, [])
            entry["nodes"].append({"node": node.node_id, "state": node.state, "name": fabric["name"],
                                   "adapters": fabric.get("adapters", []), "rate_gbps": fabric.get("rate_gbps"),
                                   "degraded": fabric.get("degraded", "")})
    for entry in found.values():
        entry["names"].sort()
        entry["nodes"].sort(key=lambda n: n["node"])
        entry["standby"] = sum(1 for m in entry["subnet_managers"] if m.get("state") == "standby")
    return sorted(found.values(), key=lambda f: (not f["verified"], f["names"], f["id"]))


def problems(nodes: list[NodeView]) -> list[dict]:
    """Every declared fabric a node cannot use, with the node's own words."""
    out = []
    for node in nodes:
        said = node.facts.status.get("fabric_problems", node.facts.registration.get("fabric_problems")) or []
        out += [{"node": node.node_id, "problem": text} for text in said]
    return out


def nvlink(nodes: list[NodeView]) -> list[dict]:
    """Every multi-node NVLink domain the nodes' cards have joined, with each node's cards and IMEX."""
    domains: dict[str, dict] = {}
    for node in nodes:
        imex = (node.facts.registration.get("imex") or {}) | (node.facts.status.get("imex") or {})
        cards: dict[str, list[int]] = {}
        for gpu in node.facts.gpus or ():
            if gpu.nvlink_domain:
                cards.setdefault(gpu.nvlink_domain, []).append(gpu.index)
        every = [g.index for g in node.facts.gpus or ()]
        for domain, joined in cards.items():
            entry = domains.setdefault(domain, {"domain": domain, "nodes": []})
            entry["nodes"].append({"node": node.node_id, "state": node.state, "joined": joined,
                                   "not_joined": [i for i in every if i not in joined],
                                   "imex": imex.get("state", ""), "imex_channels": imex.get("channels")})
    for entry in domains.values():
        entry["nodes"].sort(key=lambda n: n["node"])
        entry["usable"] = [n["node"] for n in entry["nodes"] if not n["not_joined"] and n["imex"] == "active"]
    return sorted(domains.values(), key=lambda d: d["domain"])
