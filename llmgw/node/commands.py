"""What the agent does with each command from the controller: start, stop or drain a shard, list or remove weights,
logs, one side of a fabric test, a scan of a fabric and an engine's install (each of the last three in a thread of its
own: they run for seconds or minutes, and heartbeats go on, carrying an install's progress)."""

from __future__ import annotations

import threading

from llmgw.node import perftest, subnetmanagers
from llmgw.node.installer import InstallError
from llmgw.node.logsources import KEPT, LogSources
from llmgw.node.supervisor import Supervisor
from llmgw.weights import LISTED_MOST

DRAIN_TIMEOUT = 60.0  # seconds a draining engine may take to finish what it is answering


def commands(node_id: str, supervisor: Supervisor, logs: LogSources, ports=lambda: [], send=lambda reply: None):
    """What the agent does with each command from the controller; returns the replies to send. LOGS are the
    sources a `logs_request` may read; PORTS() this node's fabric ports now; SEND((type, fields)) sends a
    reply from another thread (the link's outbox)."""

    def fabric_test(message: dict) -> None:
        reply = perftest.answer(message, ports())
        send(("fabric_test_reply", {"node_id": node_id, "request_id": message["request_id"], **reply}))

    def scan_fabric(message: dict) -> None:
        mine = {(p["hca"], p["port"]) for p in ports()}
        where = (message["hca"], message["port"])
        reply = subnetmanagers.scan(*where) if where in mine else {"error": f"no port {where[0]}/{where[1]} here"}
        send(("scan_fabric_reply", {"node_id": node_id, "request_id": message["request_id"], **reply}))

    def install(engine: str) -> None:
        try:
            supervisor.installer.ensure(engine)
        except InstallError:
            pass  # kept as the install's state, with its fix, which the next heartbeat carries

    def handle(message: dict) -> list[tuple[str, dict]]:
        kind, request_id = message["type"], message["request_id"]
        if kind == "install_engine":
            engine, installer = message["engine"], supervisor.installer
            if installer is None or engine not in installer.installable():
                return [("ack", {"node_id": node_id, "request_id": request_id, "ok": False,
                                 "error": f"{node_id}'s engine catalogue ([[engines]]) has no {engine} for its platform"})]
            threading.Thread(target=install, args=(engine,), name=f"install-{engine}", daemon=True).start()
            return [("ack", {"node_id": node_id, "request_id": request_id, "ok": True})]
        if kind == "fabric_test":
            threading.Thread(target=fabric_test, args=(message,), name="fabric-test", daemon=True).start()
            return []
        if kind == "scan_fabric":
            threading.Thread(target=scan_fabric, args=(message,), name="fabric-scan", daemon=True).start()
            return []
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
        if kind == "logs_request":
            return [("logs_reply", {"node_id": node_id, "request_id": request_id,
                                    **_logs_reply(node_id, logs, message)})]
        raise ValueError(f"no command {kind!r}")  # controllerlink.COMMANDS names one this does not answer

    return handle


def _logs_reply(node_id: str, logs: LogSources, message: dict) -> dict:
    """The fields of the `logs_reply` to MESSAGE: the source's lines from its cursor, or why there are none."""
    names = logs.names()
    source = message.get("source")
    if source is None:
        return {"sources": names}
    page = logs.read(source, message.get("after"), max(1, min(message.get("lines", 200), KEPT)))
    if page is None:
        return {"sources": names, "error": f"no source {source!r} on {node_id}; its sources are "
                                           f"{', '.join(names)}"}
    return {"lines": page.lines, "cursor": page.cursor, "sources": names,
            **({"skipped": page.skipped} if "after" in message else {})}
