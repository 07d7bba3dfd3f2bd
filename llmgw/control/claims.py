"""What a node may say about a shard, judged before the controller's view of replicas takes it.

A node's key proves which node speaks, not that what it says is true. With
a valid key, a node once registered listing a shard nobody placed (any
catalog model, any URL, `ready`), the controller adopted it as the node's,
and gateways sent that model's prompts, with the engine's key, to the URL.
So a shard status is held to these rules here:

- Its engine's URL is on the node's own address: the one its connection comes
  from, as the socket saw it (not the `address` it says it has). Loopback
  only for a node that connects over loopback: anything else pointed at
  127.0.0.1 would have gateways dial their own machine's services.
- A shard this controller did not place is taken only while the controller
  has just started (`Fleet.adopting`: `controller.lost_after`, or while it
  settles): that is when a node brings back the replicas a controller placed
  before it restarted. Later, a shard it does not know is no replica of its
  own, and is refused.
- Even then, only a model in the catalog, run the way one of its profiles
  would run it on that node (`placement.may_run`), and a rank of a replica
  over several nodes only with an id of its group's form and the seal it
  was placed there with (llmgw/control/seals.py): without it, a node whose
  key leaked could take an honest node's rank of a group before that node
  is back.
- The address where a replica's ranks meet (`master`, which the controller
  sends the other ranks' nodes to) is on the node's own address too, as its
  URL is: a node's key would otherwise point other nodes' engines anywhere.

Which node owns a shard the controller knows is `Replicas.report`'s check.
Thread-safe: it reads the fleet and the replicas under their own locks.
"""

from __future__ import annotations

from typing import Callable

from llmgw import addresses
from llmgw.control import placement, seals
from llmgw.control.catalog import Model
from llmgw.control.fleet import Fleet
from llmgw.control.reconciler import Replicas


class ShardClaims:
    def __init__(self, fleet: Fleet, replicas: Replicas, models: Callable[[], dict[str, Model]]):
        """MODELS: the catalog's models now."""
        self.fleet = fleet
        self.replicas = replicas
        self.models = models

    def judge(self, node_id: str, shard: dict, now: float, adopting: bool) -> str | None:
        """Why NODE_ID may not say SHARD (a shard status, or a shard listed at registration), or None. ADOPTING:
        whether a node could bring back replicas when the message came (`Fleet.adopting`, asked before a
        registration is taken, since the last expected node's own registration ends its settling)."""
        node = self.fleet.view(node_id, now)
        if node is None:
            return "the node is not registered"
        url = shard.get("url")
        if url is not None and not addresses.same_machine(addresses.url_host(url), node.address):
            return (f"its engine's URL {url[:200]} is not on the node's own address {node.address} (the address "
                    "it connects from); an engine must listen there: leave agent.engine_host empty, or set it "
                    "to that address")
        master = shard.get("master")
        if master is not None:
            # Where the other ranks of its replica are told to connect: never another machine's service.
            try:
                host, _ = addresses.parse(master, "master")
            except ValueError:
                host = None
            if not addresses.same_machine(host, node.address):
                return (f"the address its ranks meet at, {master[:200]}, is not on the node's own address "
                        f"{node.address}")
        shard_id = shard["shard_id"]
        if self.replicas.knows(shard_id):
            return None
        if not adopting:
            return (f"this controller did not place {shard_id}, and a node brings back the replicas placed "
                    "before the controller started only while it starts")
        group = shard.get("group")
        if group is not None:
            rank, ranks = shard.get("rank"), shard.get("ranks")
            if not isinstance(rank, int) or not isinstance(ranks, int) or not rank < ranks \
                    or shard_id != f"{group}-r{rank}":
                return f"{shard_id} does not read as rank {rank} of {ranks} of the replica {group[:200]} (GROUP-rRANK)"
            if self.replicas.seal_key is not None and not seals.holds(self.replicas.seal_key, node_id, shard):
                return (f"{shard_id} does not carry the seal of rank {rank} of {group[:200]} on {node_id}: it was not "
                        "placed there")
        model = self.models().get(shard.get("model", ""))
        if model is None:
            return f"{str(shard.get('model'))[:200]!r} is not a model in the catalog"
        reason = placement.may_run(model, node, shard)
        return None if reason is None else f"{model.name} could not have been placed there: {reason}"
