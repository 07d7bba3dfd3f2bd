"""Where a new replica of a model can run, and, for every node where it cannot, why.

Pure: it takes the nodes as the controller knows them and the replicas already
placed, and returns a decision or the reasons. A node is a candidate for a
profile only if it is ready (not cordoned, unreachable or lost), has the
profile's engine installed and seen to run (or its engine catalogue can install it there: placing
the replica installs it, and an install under way or failed is the node's reason), carries every label the profile
selects on, has enough GPUs of the profile's class free (indices not held by
another replica, and healthy in the node's latest report: a card that fails
after registration is not offered), and enough memory not already claimed by replicas placed
there: a claim counts from the moment of placement, so two models are never
given the same memory between two heartbeats. Of the free cards, the set joined best by NVLink is
given (llmgw/control/gpusets.py). Profiles are tried by priority;
among candidates, the node with the fewest replicas of this model wins (spread),
then the one with the most unclaimed memory.
"""

from __future__ import annotations

import dataclasses
import heapq

from llmgw.control import gpusets, multinode
from llmgw.control.catalog import Model, Profile
from llmgw.control.fleet import READY, NodeView

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a placed replica holds on its node."""
    node_id: str
    model: str
    memory_bytes: int
    gpus: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Decision:
    node_id: str
    profile: Profile
    gpus: tuple[int, ...]


def memory_claim(profile: Profile) -> int:
    return int(profile.min_memory_gb * GiB)


def _by_node(claims: list[Claim]) -> dict[str, list[Claim]]:
    held: dict[str, list[Claim]] = {}
    for claim in claims:
        held.setdefault(claim.node_id, []).append(claim)
    return held


def _unclaimed(node: NodeView, held: list[Claim]) -> int | None:
    total = node.facts.memory_total_bytes
    return None if total is None else total - sum(c.memory_bytes for c in held)


def _refusal(node: NodeView, profile: Profile, held: list[Claim], model: Model,
             adapters: tuple[str, ...] = (), choose: bool = True) -> tuple[str | None, tuple[int, ...]]:
    """(None, gpus) when NODE, holding HELD, can take a replica with PROFILE (of a multi-node one: a shard,
    its cards near ADAPTERS), else (reason, ()). CHOOSE false: whether it can, without choosing its cards
    (gpus then empty), the costly part, which only the node chosen needs."""
    if node.state != READY:
        return f"node is {node.state}", ()
    facts = node.facts
    if facts.engines is None:
        return "the node has not said which engines it runs (an old agent?)", ()
    install = facts.install(profile.engine)
    if install and install.get("state") == "failed":
        return (f"installing engine {profile.engine} {facts.installable[profile.engine]} failed there: "
                f"{install.get('detail')}; {install.get('fix')}"), ()
    if profile.engine not in facts.engines:
        if install and install.get("state") == "installing":
            done = f", {install['bytes_done'] / GiB:.2f} GiB fetched" if "bytes_done" in install else ""
            return (f"engine {profile.engine} {facts.installable[profile.engine]} is being installed there "
                    f"({install.get('detail', 'starting')}{done}); the node is used once it is installed"), ()
        if profile.engine not in facts.installable:
            installed = ", ".join(sorted(facts.engines)) or "none"
            return (f"engine {profile.engine} is not installed there (installed: {installed}), and its engine "
                    "catalogue ([[engines]]) has none to install"), ()
    label = _label_refusal(facts, profile)
    if label is not None:
        return label, ()
    gpus: tuple[int, ...] = ()
    if profile.gpus:
        if facts.gpus is None:
            return "the node's GPUs are not known (its GPU probe failed)", ()
        taken = {i for c in held for i in c.gpus}
        fitting = [g for g in facts.gpus if profile.gpu_class in (None, g.gpu_class)]
        free = [g.index for g in fitting if g.index not in taken and g.healthy]
        if len(free) < profile.gpus:
            wanted = f"{profile.gpus} x {profile.gpu_class or 'any GPU'}"
            # Name the cards left out for their health: the operator's next step is on that card.
            unwell = "".join(f"; GPU {g.index}'s health is not known" if g.health is None
                             else f"; GPU {g.index} is unhealthy ({g.health})" for g in fitting if not g.healthy)
            return f"needs {wanted}, {len(free)} free of {len(fitting)}{unwell}", ()
        if choose:
            gpus = gpusets.choose([g for g in fitting if g.index in free], profile.gpus, adapters)
    elif profile.gpu_class:
        return f"profile asks for GPU class {profile.gpu_class} but 0 GPUs", ()
    if model.size_bytes and not profile.source and model.source.startswith(("http://", "https://")):
        disk = facts.disk_free_bytes
        if disk is not None and disk < model.size_bytes:
            return (f"needs {model.size_bytes / GiB:.1f} GiB of disk for the weights, "
                    f"{disk / GiB:.1f} GiB free in its weights directory"), ()
    need = memory_claim(profile)
    if need:
        unclaimed = _unclaimed(node, held)
        if unclaimed is None:
            return "the node's memory is not known", ()
        if unclaimed < need:
            return (f"needs {need / GiB:.1f} GiB of memory, {max(0, unclaimed) / GiB:.1f} GiB unclaimed "
                    f"of {(facts.memory_total_bytes or 0) / GiB:.1f} GiB"), ()
    return None, gpus


def _label_refusal(facts, profile: Profile) -> str | None:
    labels = facts.labels or {}
    for key, value in profile.node_selector:
        if labels.get(key) != value:
            return f"label {key}={value} wanted, node has {key}={labels.get(key, '(unset)')}"
    return None


def _running_refusal(node: NodeView, profile: Profile, gpus: list[int]) -> str | None:
    """Why NODE cannot be running a replica of PROFILE on the GPUs GPUS, or None when it can."""
    facts = node.facts
    if facts.engines is None or profile.engine not in facts.engines:
        return f"engine {profile.engine} is not installed there"
    label = _label_refusal(facts, profile)
    if label is not None:
        return label
    if len(gpus) != profile.gpus:
        return f"the profile takes {profile.gpus} GPUs, and the shard says it holds {len(gpus)}"
    cards = {g.index: g for g in facts.gpus or ()}
    for index in gpus:
        card = cards.get(index)
        if card is None:
            return f"the node has no GPU {index}"
        if profile.gpu_class not in (None, card.gpu_class):
            return f"GPU {index} is {card.gpu_class}, and the profile wants {profile.gpu_class}"
    return None


def may_run(model: Model, node: NodeView, shard: dict) -> str | None:
    """Why NODE cannot be running SHARD (a shard status naming MODEL), or None when placement would have put
    it there: by the profile its fingerprint names, or, for a profile edited since it started (its replica
    then shows a stale profile), by any profile of the same engine. What other replicas hold and the node's
    state (cordoned, draining) are left out: the replica exists already, and holds its share."""
    fingerprint, engine = shard.get("profile_fp"), shard.get("engine")
    profiles = ([p for p in model.profiles if model.fingerprint(p) == fingerprint]
                or [p for p in model.profiles if p.engine == engine])
    ranks = shard.get("ranks") or 1
    profiles = [p for p in profiles if p.nodes == ranks]
    if not profiles:
        return f"{model.name} has no profile for engine {engine!r} over {ranks} node{'s' if ranks > 1 else ''}"
    reasons = [_running_refusal(node, profile, list(shard.get("gpus") or ())) for profile in profiles]
    return None if None in reasons else reasons[0]


def place(model: Model, nodes: list[NodeView], claims: list[Claim], leaves: dict[str, dict[str, str]] | None = None
          ) -> tuple[Decision | multinode.GroupDecision | None, dict[str, str]]:
    """Where one more replica of MODEL runs (a node, or for a profile over several nodes, a GroupDecision:
    its nodes, rank 0 first), or None with every node's reason. LEAVES as `over_nodes` takes them."""
    return Placer(nodes, claims, leaves).place(model, every_reason=True)


class Placer:
    """Placement of many replicas in one pass, each decision what `place` would give at that point.

    A pass that placed R replicas over N nodes weighed every node for every replica (R x N), and chose cards
    on each (gpusets scores every subset): 4,000 replicas over 1,000 nodes held the pass, and with it the
    replicas' lock the control loop needs, for minutes. Here each node is weighed once for a model's
    profile, and again only after a replica lands on it, since a placement changes only what its own nodes
    hold; candidates wait in a heap by rank; and cards are chosen on the winner alone (a node's rank does not
    depend on which of its cards are chosen). So a model's replicas cost N + R weighings, and one set of
    cards each.
    """

    def __init__(self, nodes: list[NodeView], claims: list[Claim], leaves: dict[str, dict[str, str]] | None = None):
        self.nodes, self.leaves = nodes, leaves
        self.by_id = {node.node_id: node for node in nodes}
        self.held = _by_node(claims)
        self.model: Model | None = None
        self.weighed: dict[int, dict[str, tuple[str | None, tuple]]] = {}  # profile -> node -> (reason, rank)
        self.heaps: dict[int, list[tuple]] = {}

    def place(self, model: Model, every_reason: bool = False
              ) -> tuple[Decision | multinode.GroupDecision | None, dict[str, str]]:
        """As `place`; where a place is found, the reasons of the nodes refused are given only with EVERY_REASON
        (a pass reads them only where none is found, and gathering them for each replica is R x N again)."""
        if model is not self.model:
            self.model, self.weighed, self.heaps = model, {}, {}
        reasons: dict[str, str] = {}
        for i, profile in enumerate(model.profiles):
            if profile.nodes > 1:
                group, why = over_nodes(model, profile, self.nodes, self.held, self.leaves)
                if group is not None:
                    return group, reasons
                reasons.update({_label(model, profile, k): v for k, v in why.items()})
                continue
            if i not in self.weighed:
                self.weighed[i], self.heaps[i] = {}, []
                for node in self.nodes:
                    self._weigh(model, i, profile, node)
            weighed, heap = self.weighed[i], self.heaps[i]
            while heap and weighed[heap[0][-1]][1] != heap[0]:
                heapq.heappop(heap)  # a node weighed again since: its fresh rank is further in
            if heap:
                node_id = heap[0][-1]
                if every_reason:
                    reasons.update({_label(model, profile, other): why for other, (why, _) in weighed.items()
                                    if why is not None})
                reason, gpus = _refusal(self.by_id[node_id], profile, self.held.get(node_id, []), model)
                assert reason is None, reason  # weighed on the same facts a moment ago
                return Decision(node_id, profile, gpus), reasons
            reasons.update({_label(model, profile, node_id): why for node_id, (why, _) in weighed.items()
                            if why is not None})
        if not self.nodes:
            reasons["(none)"] = "no node has registered"
        return None, reasons

    def taken(self, claims: list[Claim]) -> None:
        """CLAIMS were just placed: held from now on, and their nodes weighed again for the model placed."""
        for claim in claims:
            self.held.setdefault(claim.node_id, []).append(claim)
        model = self.model
        if model is None:
            return  # nothing weighed yet
        for i, weighed in self.weighed.items():
            for node_id in {claim.node_id for claim in claims} & weighed.keys():
                self._weigh(model, i, model.profiles[i], self.by_id[node_id])

    def _weigh(self, model: Model, i: int, profile: Profile, node: NodeView) -> None:
        mine = self.held.get(node.node_id, [])
        reason, _ = _refusal(node, profile, mine, model, choose=False)
        rank = () if reason is not None else (*_spread(model, node, mine), node.node_id)
        self.weighed[i][node.node_id] = (reason, rank)
        if rank:
            heapq.heappush(self.heaps[i], rank)


def _label(model: Model, profile: Profile, where: str) -> str:
    return where if len(model.profiles) == 1 else f"{where} ({profile.name})"


def _spread(model: Model, node: NodeView, mine: list[Claim]) -> tuple[int, int]:
    """How a node ranks for one more replica of MODEL, lowest first: fewest replicas of it there (spread), then
    the most unclaimed memory (a node whose memory is not known after every node with some)."""
    unclaimed = _unclaimed(node, mine)
    return sum(1 for c in mine if c.model == model.name), -unclaimed if unclaimed is not None else 0


def over_nodes(model: Model, profile: Profile, nodes: list[NodeView], held: dict[str, list[Claim]],
               leaves: dict[str, dict[str, str]] | None = None) -> tuple[multinode.GroupDecision | None, dict[str, str]]:
    """The nodes for one more replica of MODEL with PROFILE over several nodes (llmgw/control/multinode.py);
    LEAVES: each adapter's leaf switch (llmgw/control/fabricmaps.py)."""
    by_id = {node.node_id: node for node in nodes}
    return multinode.place(
        model, profile, nodes,
        fits=lambda node, adapters: _refusal(node, profile, held.get(node.node_id, []), model, adapters),
        here=lambda node_id: _spread(model, by_id[node_id], held.get(node_id, [])), leaves=leaves)


def _fits(node: NodeView, gpus: tuple[int, ...]) -> str:
    if not gpus:
        return "fits"
    pairs = gpusets.nvlink_pairs(list(node.facts.gpus or ()), gpus)
    joined = f"; {pairs} NVLink pair{'s' if pairs != 1 else ''} among them" if pairs else ""
    return f"fits (GPUs {', '.join(map(str, gpus))}{joined})"


def explain(model: Model, nodes: list[NodeView], claims: list[Claim],
            leaves: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """For `llmgw ctl explain-placement`: every node and profile, with yes or its reason; LEAVES as
    `over_nodes` takes them."""
    rows = []
    held = _by_node(claims)
    for profile in model.profiles:
        if profile.nodes > 1:
            rows += _explain_over_nodes(model, profile, nodes, held, leaves)
            continue
        for node in nodes:
            reason, gpus = _refusal(node, profile, held.get(node.node_id, []), model)
            rows.append({"node": node.node_id, "profile": profile.name, "fits": reason is None,
                         "reason": reason or _fits(node, gpus)})
    return rows


def _explain_over_nodes(model: Model, profile: Profile, nodes: list[NodeView], held: dict[str, list[Claim]],
                        leaves: dict[str, dict[str, str]] | None) -> list[dict]:
    group, reasons = over_nodes(model, profile, nodes, held, leaves)
    ranks = {r.node_id: (i, r) for i, r in enumerate(group.ranks)} if group else {}
    island = group.island.name if group else ""
    rows = []
    for node in nodes:
        if node.node_id in ranks:
            i, rank = ranks[node.node_id]
            on = f"rank {i} of {profile.nodes} on {island}" + (" (serves HTTP)" if i == 0 else "")
            rows.append({"node": node.node_id, "profile": profile.name, "fits": True,
                         "reason": f"{_fits(node, rank.gpus)}: {on}"})
        else:
            rows.append({"node": node.node_id, "profile": profile.name, "fits": False,
                         "reason": reasons.get(node.node_id) or "another fabric's nodes were chosen"})
    rows += [{"node": where, "profile": profile.name, "fits": False, "reason": why}
             for where, why in reasons.items() if where not in {n.node_id for n in nodes}]
    return rows
