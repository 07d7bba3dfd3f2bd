"""Seals: what proves a rank of a replica over several nodes was placed on the node that reports it.

A controller keeps no record of replicas (llmgw/control/reconciler.py): a restarted one learns them from
the agents, within its adoption window. A rank claims its group by id alone, so a node whose key leaked
could claim a rank of an honest node's group before that node is back: the honest rank would be refused,
its cards counted free, and the group's fate in the hands of the claimant. So each rank's `start_shard`
carries a seal, an HMAC of its group, rank, ranks, model and node under a key derived from the
controller's own secret (shared by every controller of the cluster, since agents check it), which the
agent keeps with the shard and reports back; a rank is adopted only with the seal its node could have
been given. In plaintext mode there is no secret, and nothing to prove: any node may claim anything there.
"""

from __future__ import annotations

import hashlib
import hmac

DOMAIN = b"llmgw: the seal of a rank of a replica over several nodes, v1"


def key_of(secret: bytes) -> bytes:
    """The seal key for the controller's SECRET (its CURVE secret key): never the secret itself."""
    return hmac.new(secret, DOMAIN, hashlib.sha256).digest()


def seal(key: bytes, node_id: str, model: str, group: str, rank: int, ranks: int) -> str:
    fields = "\0".join((node_id, model, group, str(rank), str(ranks))).encode()
    return hmac.new(key, fields, hashlib.sha256).hexdigest()


def holds(key: bytes, node_id: str, shard: dict) -> bool:
    """Whether SHARD (a shard status NODE_ID sent) carries the seal of its group, rank, ranks and model on
    NODE_ID."""
    given = shard.get("seal")
    if not isinstance(given, str):
        return False
    expected = seal(key, node_id, str(shard.get("model")), str(shard.get("group")), shard.get("rank", -1),
                    shard.get("ranks", -1))
    return hmac.compare_digest(given.encode(), expected.encode())
