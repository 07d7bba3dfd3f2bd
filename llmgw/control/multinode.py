"""Where a replica bigger than one node can run: a set of nodes sharing one fabric, and, for every node
and fabric left out, why.

A profile with `nodes = N` runs one engine a node on N nodes (`gpus` is per node), and their collectives
need a fabric all of them share. The nodes that could each take a shard (the same checks as a single-node
replica: state, engine, labels, GPUs, memory; llmgw/control/placement.py) are grouped into islands:

- a multi-node NVLink domain: nodes every one of whose cards has joined the same domain
  (`nvl:<cluster>/<clique>`) and whose IMEX is up, preferred over any network;
- else one physical fabric: the usable `[[fabrics]]` of each node with the same physical identity (the
  lowest subnet manager GUID, or the RoCE network; llmgw/node/fabrics.py). A fabric whose identity the
  node could not read yet is an island of its own name, kept apart from those whose identity is known.

Never across islands; a node with no fabric serves single-node replicas only. Within an island the nodes
with a degraded port (a cable that trained down) come last, then spread (fewest replicas of this model),
then the most unclaimed memory; and where enough of them hang off the same leaf switches (each adapter's
leaf, from the fabric's last scan: llmgw/control/fabricmaps.py; on a rail-optimised fabric, the same leaf
a rail), those are taken together, so the replica's traffic stays off the spine. Of the islands that can
take it, a domain beats a fabric, then the one whose chosen nodes have fewest degraded ports, then one
whose nodes share their leaves, then the fastest, then by name. Each node's cards are chosen nearest that
node's adapters on the island (llmgw/control/gpusets.py).
"""

from __future__ import annotations

import dataclasses

from llmgw.control.catalog import Model, Profile
from llmgw.control.fleet import NodeView


@dataclasses.dataclass(frozen=True)
class Rank:
    """One shard of a multi-node replica: where it runs, on which cards, sending on which adapters."""
    node_id: str
    gpus: tuple[int, ...]
    adapters: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Island:
    """Nodes whose engines can run collectives together."""
    key: str  # "nvl:<cluster>/<clique>", a fabric's physical identity, or "unverified:<name>"
    name: str  # what an operator calls it: the fabric's declared name, or the domain
    rate_gbps: float


@dataclasses.dataclass(frozen=True)
class GroupDecision:
    profile: Profile
    island: Island
    ranks: tuple[Rank, ...]  # rank 0 first: the leader, which serves HTTP


def islands_of(node: NodeView) -> list[tuple[Island, tuple[str, ...], str]]:
    """The islands NODE is on: (island, its adapters there, why it is degraded there or "")."""
    out: list[tuple[Island, tuple[str, ...], str]] = []
    gpus = node.facts.gpus or ()
    domains = {g.nvlink_domain for g in gpus}
    imex = (node.facts.registration.get("imex") or {}) | (node.facts.status.get("imex") or {})
    if len(domains) == 1 and None not in domains and imex.get("state") == "active":
        domain = domains.pop()
        out.append((Island(f"nvl:{domain}", f"NVLink domain {domain}", 0.0), (), ""))
    for fabric in node.facts.fabrics:
        physical = fabric.get("physical") or f"unverified:{fabric['name']}"
        out.append((Island(physical, fabric["name"], float(fabric.get("rate_gbps") or 0.0)),
                    tuple(fabric.get("adapters") or ()), fabric.get("degraded") or ""))
    return out


def leaf_key(node: NodeView, adapters: tuple[str, ...], leaves: dict[str, str]) -> tuple | None:
    """Which leaf switch each of NODE's ADAPTERS hangs off, adapter by adapter (LEAVES: adapter node GUID ->
    leaf, on the island's fabric), None where one is not known. Two nodes with equal keys send each rail
    through the same leaf; cabled crosswise, they do not."""
    found = []
    for hca in sorted(adapters):
        port = next((p for p in node.facts.ib_ports if p["hca"] == hca), None)
        leaf = leaves.get(port.get("node_guid", "")) if port else None
        if leaf is None:
            return None
        found.append((hca, leaf))
    return tuple(found) if found else None


def place(model: Model, profile: Profile, nodes: list[NodeView], fits, here,
          leaves: dict[str, dict[str, str]] | None = None) -> tuple[GroupDecision | None, dict[str, str]]:
    """PROFILE's nodes for one more replica of MODEL (PROFILE.nodes > 1), or None with the reasons.

    FITS(node, adapters) -> (reason or None, gpus): whether NODE can take one shard, its cards chosen near
    ADAPTERS (placement's per-node checks). HERE(node_id) -> (replicas of MODEL there, -unclaimed memory):
    the spread order. LEAVES: by fabric, each adapter's leaf switch by its node GUID (fabricmaps.Maps.leaves):
    a map is read only for the island it is of."""
    reasons: dict[str, str] = {}
    leaves = leaves or {}
    # island key -> (node, its rank there, degraded, its leaves there)
    members: dict[str, list[tuple[str, Rank, str, tuple | None]]] = {}
    named: dict[str, Island] = {}
    for node in nodes:
        islands = islands_of(node)
        if not islands:
            reason, _ = fits(node, ())
            reasons[node.node_id] = reason or (f"it has no fabric: a replica over {profile.nodes} nodes runs only "
                                               "on nodes sharing one (the agent's [[fabrics]]), and a node without "
                                               "one serves single-node replicas")
            continue
        for island, adapters, degraded in islands:
            if any(m[0] == node.node_id for m in members.get(island.key, [])):
                continue  # two of its declared names are one physical fabric: one shard there at most
            reason, gpus = fits(node, adapters)
            if reason is not None:
                reasons[node.node_id] = reason
                continue
            named.setdefault(island.key, island)
            members.setdefault(island.key, []).append((node.node_id, Rank(node.node_id, gpus, adapters), degraded,
                                                       leaf_key(node, adapters, leaves.get(island.key, {}))))
    choices = []
    for key, fitting in members.items():
        island = named[key]
        if len(fitting) < profile.nodes:
            reasons[f"{island.name} ({key})"] = (f"{len(fitting)} of its nodes can take a shard "
                                                 f"({', '.join(n for n, _, _, _ in fitting)}), {profile.nodes} needed")
            continue
        order = {m[0]: (bool(m[2]), *here(m[0]), m[0]) for m in fitting}
        fitting.sort(key=lambda member: order[member[0]])
        together: dict[tuple, list] = {}
        for member in fitting:
            if member[3] is not None:
                together.setdefault(member[3], []).append(member)
        enough = [group[:profile.nodes] for group in together.values() if len(group) >= profile.nodes]
        chosen = min(enough, key=lambda group: [order[m[0]] for m in group]) if enough else fitting[:profile.nodes]
        slow = sum(1 for _, _, why, _ in chosen if why)
        choices.append(((not key.startswith("nvl:"), slow, not enough, -island.rate_gbps, island.name),
                        GroupDecision(profile, island, tuple(rank for _, rank, _, _ in chosen))))
    if not choices:
        return None, reasons
    return min(choices, key=lambda choice: choice[0])[1], reasons
