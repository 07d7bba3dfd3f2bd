"""The messages between agents and the controller: versioned JSON, fields only ever added.

Each message is one JSON object with `v` (the protocol version that wrote it)
and `type`. A reader ignores fields it does not know (a newer peer wrote them)
and treats a field that is absent as "not known", never as zero or empty: a
node that did not probe its GPUs sends no `gpus`, which is different from
`"gpus": []` (probed, none found). `docs/protocol.md` describes every message;
a test keeps that page and `MESSAGES` in step.

Only the shape is checked here: required fields present with the right JSON
types. What a message means is the controller's and the agent's business.
"""

from __future__ import annotations

from llmgw.wire.schema import ProtocolError, Schema

__all__ = ["MESSAGES", "VERSION", "ProtocolError", "decode", "encode"]

VERSION = 1

# type -> {field: (json type, required)}. Add fields; never remove or retype one.
MESSAGES: dict[str, dict[str, tuple[str, bool]]] = {
    # agent -> controller
    "register": {
        "node_id": ("str", True), "agent_version": ("str", True), "address": ("str", False),
        "labels": ("object", False), "hostname": ("str", False),
        "cpu": ("object", False), "memory": ("object", False), "disk": ("object", False),
        "gpus": ("array", False), "gpus_probed": ("bool", False), "gpu_probe_error": ("str", False),
        "engines": ("object", False), "engines_probed": ("bool", False), "shards": ("array", False),
        "doctor": ("object", False), "weights": ("object", False),
        "installable": ("object", False), "installs": ("object", False),
    },
    "heartbeat": {
        "node_id": ("str", True), "seq": ("int", True), "memory": ("object", False), "load": ("object", False),
        "disk": ("object", False), "gpus": ("array", False), "engines": ("object", False),
        "engines_changed": ("bool", False), "weights": ("object", False), "installs": ("object", False),
    },
    "shard_status": {
        "node_id": ("str", True), "shard_id": ("str", True), "state": ("str", True), "model": ("str", False),
        "engine": ("str", False), "port": ("int", False), "url": ("str", False), "profile_fp": ("str", False),
        "gpus": ("array", False), "pid": ("int", False), "exit_code": ("int", False),
        "last_output": ("array", False), "fetch": ("object", False), "detail": ("str", False),
        "ready_s": ("number", False), "api_key": ("str", False),
    },
    "ack": {"node_id": ("str", True), "request_id": ("str", True), "ok": ("bool", True), "error": ("str", False)},
    "logs_reply": {"node_id": ("str", True), "request_id": ("str", True), "lines": ("array", False),
                   "sources": ("array", False), "error": ("str", False), "cursor": ("int", False),
                   "skipped": ("bool", False)},
    "weights_reply": {"node_id": ("str", True), "request_id": ("str", True), "weights_dir": ("str", False),
                      "entries": ("int", False), "bytes": ("int", False), "fetched_bytes": ("int", False),
                      "files": ("array", False), "truncated": ("bool", False), "removed": ("array", False),
                      "refused": ("object", False)},
    # controller -> agent
    "registered": {"node_id": ("str", True), "heartbeat_interval": ("number", False)},
    "start_shard": {
        "request_id": ("str", True), "shard_id": ("str", True), "model": ("str", True), "engine": ("str", True),
        "source": ("str", True), "args": ("array", False), "env": ("object", False), "gpus": ("array", False),
        "profile_fp": ("str", False), "max_context": ("int", False),
    },
    "stop_shard": {"request_id": ("str", True), "shard_id": ("str", True)},
    "drain_shard": {"request_id": ("str", True), "shard_id": ("str", True), "timeout": ("number", False)},
    "remove_weights": {"request_id": ("str", True), "source": ("str", True)},
    "logs_request": {"request_id": ("str", True), "source": ("str", False), "lines": ("int", False),
                     "after": ("int", False)},
    "weights_request": {"request_id": ("str", True), "most": ("int", False)},
    "reclaim_weights": {"request_id": ("str", True), "names": ("array", True)},
    "heartbeat_ack": {"seq": ("int", True)},
    "register_again": {"reason": ("str", True)},
    "refused": {"reason": ("str", True)},
}

_SCHEMA = Schema(MESSAGES, VERSION)
encode = _SCHEMA.encode
decode = _SCHEMA.decode
