"""What a node may say about a shard, judged before the controller's view of replicas takes it.

A node's key proves which node speaks, not that what it says is true. With
a valid key, a node once registered listing a shard nobody placed (any
catalog model, any URL, `ready`), the controller adopted it as the node's,
and gateways sent that model's prompts, with the engine's key, to the URL.
So a shard status is held to three rules here:

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
  would run it on that node (`placement.may_run`).

Which node owns a shard the controller knows is `Replicas.report`'s check.
Thread-safe: it reads the fleet and the replicas under their own locks.
"""

from __future__ import annotations

from typing import Callable

from llmgw import addresses
from llmgw.control import placement
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
        shard_id = shard["shard_id"]
        if self.replicas.knows(shard_id):
            return None
        if not adopting:
            return (f"this controller did not place {shard_id}, and a node brings back the replicas placed "
                    "before the controller started only while it starts")
        model = self.models().get(shard.get("model", ""))
        if model is None:
            return f"{str(shard.get('model'))[:200]!r} is not a model in the catalog"
        reason = placement.may_run(model, node, shard)
        return None if reason is None else f"{model.name} could not have been placed there: {reason}"
