"""What the agent does with each command from the controller: start, stop or drain a shard, list or remove weights, logs."""

from __future__ import annotations

from llmgw.node.supervisor import Supervisor
from llmgw.weights import LISTED_MOST

DRAIN_TIMEOUT = 60.0  # seconds a draining engine may take to finish what it is answering


def commands(node_id: str, supervisor: Supervisor):
    """What the agent does with each command from the controller; returns the replies to send."""

    def handle(message: dict) -> list[tuple[str, dict]]:
        kind, request_id = message["type"], message["request_id"]
        if kind == "start_shard":
            supervisor.start({k: v for k, v in message.items() if k not in ("v", "type", "request_id")})
            return [("ack", {"node_id": node_id, "request_id": request_id, "ok": True})]
        if kind in ("stop_shard", "drain_shard"):
            # Stopping what is not running is done already: commands are idempotent.
            drain = message.get("timeout", DRAIN_TIMEOUT) if kind == "drain_shard" else None
            supervisor.stop(message["shard_id"], drain=drain)
            return [("ack", {"node_id": node_id, "request_id": request_id, "ok": True})]
        if kind == "remove_weights":
            refusal = supervisor.remove_weights(message["source"])
            return [("ack", {"node_id": node_id, "request_id": request_id, "ok": refusal is None,
                             **({"error": refusal} if refusal else {})})]
        if kind in ("weights_request", "reclaim_weights"):
            # A reclaim is answered with what was removed and refused, and the listing as it is after it.
            removed, refused = supervisor.reclaim(message["names"]) if kind == "reclaim_weights" else (None, None)
            most = message.get("most", LISTED_MOST)
            return [("weights_reply", {"node_id": node_id, "request_id": request_id, "removed": removed,
                                       "refused": refused, **supervisor.weights(max(0, min(most, LISTED_MOST)))})]
        lines, sources = supervisor.logs(message.get("source"), message.get("lines", 200))
        if message.get("source") and not lines and message["source"] not in sources:
            return [("logs_reply", {"node_id": node_id, "request_id": request_id, "sources": sources,
                                    "error": f"no shard {message['source']!r} on {node_id}; sources: "
                                             f"{', '.join(sources) or 'none'}"})]
        return [("logs_reply", {"node_id": node_id, "request_id": request_id, "lines": lines,
                                "sources": sources})]

    return handle
