"""The messages between agents and the controller: versioned JSON, fields only ever added.

Each message is one JSON object with `v` (the protocol version that wrote it)
and `type`. A reader ignores fields it does not know (a newer peer wrote them)
and treats a field that is absent as "not known", never as zero or empty: a
node that did not probe its GPUs sends no `gpus`, which is different from
`"gpus": []` (probed, none found). `docs/protocol.md` describes every message;
a test keeps that page and `MESSAGES` in step.

Only the shape is checked here: required fields present with the right types. A node whose key leaked
is an attacker, and placement compares and the pages format what it says about itself, so the facts of
`register` and `heartbeat` (and every shard status) are checked all the way down: numbers finite and
bounded, strings and lists of bounded length, maps of bounded size. Fields inside them that this
version does not know are let by (a newer agent wrote them), within the message's size and depth.
What a message means is the controller's and the agent's business.
"""

from __future__ import annotations

from llmgw.wire.schema import Either, Int, ListOf, MapOf, Num, Obj, ProtocolError, Schema, Str

__all__ = ["MESSAGES", "VERSION", "ProtocolError", "decode", "encode"]

VERSION = 1

LARGEST = 16 * 1024 * 1024  # bytes: a logs reply is at most 256 KiB of text, a weights listing far less
DEEPEST = 16  # levels of arrays and objects: the deepest message here (a shard's fetch in a register) has 4
BYTES = Int(0, 2**53)  # beyond this no JSON reader is exact; a petabyte-scale disk is still far within
COUNT = Int(0, 2**53)
FIGURE = Num(0, 1e12)  # a measured load, count or share: finite and non-negative
PERCENT = Num(0, 100)
MOST_RANKS = 64  # nodes one replica runs over
NAME = Str(200)  # a shard id, an engine's or a label's name
TEXT = Str(4000)  # a sentence: a detail, a fix, an error
VERSION_TEXT = Str(500)  # an engine's version, as its binary says it

CPU = Obj({"count": (Int(1, 1 << 20), False), "flags": (ListOf(Str(32), 64), False), "model": (Str(256), False)})
MEMORY = Obj({"total_bytes": (BYTES, False), "available_bytes": (BYTES, False)})
DISK = Obj({"path": (Str(4096), False), "total_bytes": (BYTES, False), "free_bytes": (BYTES, False)})
GPU = Obj({"index": (Int(0, 1023), False), "name": (Str(256), False), "class": (Str(64), False),
           "uuid": (Str(128), False), "memory_total_bytes": (BYTES, False), "memory_used_bytes": (BYTES, False),
           "compute_capability": (Str(16), False), "utilization_percent": (PERCENT, False),
           "health": (Str(64), False), "driver_version": (Str(64), False),
           # Topology (llmgw/node/gputopology.py): NVLink peers by index, distance to each adapter, NUMA node,
           # and a multi-node NVLink domain's membership.
           "pci_bus": (Str(32), False), "nvlink": (MapOf(Str(8), Int(0, 1024), 1024), False),
           "nic_paths": (MapOf(NAME, Str(8), 64), False), "numa_node": (Int(0, 4096), False),
           "nvlink_domain": (Str(200), False),
           "nvlink_fabric": (Obj({k: (Str(100), False) for k in
                                  ("state", "status", "cluster_uuid", "clique_id", "bandwidth")}), False)})
GPUS = ListOf(GPU, 1024)
GUID = Str(24)
SUBNET_MANAGER = Obj({"guid": (GUID, True), "lid": (Int(0, 65535), False), "priority": (Int(0, 15), False),
                      "state": (Str(32), False)})
IB_PORT = Obj({"hca": (NAME, True), "port": (Int(0, 255), True), "state": (Str(32), False),
               "phys_state": (Str(32), False), "link_layer": (Str(32), False), "rate_gbps": (Num(0, 1e6), False),
               "counters": (MapOf(NAME, BYTES, 64), False), "node_guid": (GUID, False), "port_guid": (GUID, False),
               "lid": (Int(0, 65535), False), "sm_lid": (Int(0, 65535), False), "numa_node": (Int(0, 4096), False),
               "firmware": (Str(64), False), "roce_gid_index": (Int(0, 255), False), "network": (Str(64), False),
               "sm": (SUBNET_MANAGER, False), "subnet_managers": (ListOf(SUBNET_MANAGER, 64), False),
               "fabric_id": (Str(64), False), "sm_error": (TEXT, False)})
FABRIC = Obj({"name": (Str(64), True), "physical": (Str(80), False), "adapters": (ListOf(NAME, 64), False),
              "declared": (ListOf(NAME, 64), False),
              "link_layer": (Str(32), False), "rate_gbps": (Num(0, 1e6), False), "degraded": (TEXT, False)})
IMEX = Obj({"state": (Str(32), False), "channels": (Int(0, 1 << 20), False)})
# What a node says of its fabrics: its ports, the declared fabrics found usable, and why the others are not.
FABRIC_FACTS: dict[str, tuple[object, bool]] = {
    "ib_ports": (ListOf(IB_PORT, 256), False), "fabrics": (ListOf(FABRIC, 64), False),
    "fabric_problems": (ListOf(TEXT, 64), False), "imex": (IMEX, False)}
SHARD_LOAD = Obj({"shard_id": (NAME, False), "memory_rss_bytes": (BYTES, False), "cpu_cores": (FIGURE, False),
                  "waiting": (FIGURE, False), "running": (FIGURE, False), "kv_cache": (FIGURE, False)})
LOAD = Obj({"load1": (FIGURE, False), "load5": (FIGURE, False), "load15": (FIGURE, False),
            "cpu_percent": (PERCENT, False), "shards": (ListOf(SHARD_LOAD, 1024), False)})
ENGINES = MapOf(NAME, VERSION_TEXT, 64)  # engine -> version
# A TOML configuration may give a label a number or a boolean; placement's selectors compare strings.
LABELS = MapOf(NAME, Either((Str(1000), Num(-1e15, 1e15), "bool")), 256)
FINDING = Obj({"level": (Str(16), False), "area": (Str(64), False), "message": (TEXT, True), "fix": (TEXT, False)})
DOCTOR = Obj({"failures": (ListOf(FINDING, 200), False), "warnings": (ListOf(FINDING, 200), False)})
WEIGHTS = Obj({"bytes": (BYTES, False), "entries": (COUNT, False), "fetched_bytes": (BYTES, False)})
INSTALL = Obj({"state": (Str(16), False), "detail": (TEXT, False), "fix": (TEXT, False),
               "bytes_done": (BYTES, False), "bytes_total": (BYTES, False)})
INSTALLS = MapOf(Str(700), INSTALL, 256)  # ENGINE/VERSION -> its install's state
FETCH = Obj({"source": (TEXT, False), "bytes_done": (BYTES, False), "bytes_total": (BYTES, False)})
# A shard's status, as `shard_status` carries it and as `register` lists each shard the node runs.
SHARD: dict[str, tuple[object, bool]] = {
    "shard_id": (NAME, True), "state": (Str(32), True), "model": (Str(500), False),
    "engine": (NAME, False), "port": (Int(0, 65535), False), "url": (Str(2000), False),
    "profile_fp": (Str(200), False), "gpus": (ListOf(Int(0, 1023), 1024), False), "pid": (Int(0, 2**31), False),
    "exit_code": (Int(-2**31, 2**31), False), "last_output": (ListOf(Str(4000), 1000), False),
    "fetch": (FETCH, False), "detail": (TEXT, False), "ready_s": (Num(0, 1e12), False),
    "api_key": (Str(500), False), "context": (Int(1, 1 << 24), False),
    # At most one restart a probe window (a minute by default): a million is two years of them, and a node
    # saying more would only inflate its models' restart counter, which alerts read.
    "restarts": (Int(0, 10**6), False), "restart_reason": (TEXT, False),
    # A shard of a replica over several nodes: its group (the replica), its rank, how many ranks, and, from
    # rank 0, where its engine's ranks meet (HOST:PORT on rank 0's node).
    **{"group": (NAME, False), "rank": (Int(0, MOST_RANKS - 1), False), "ranks": (Int(1, MOST_RANKS), False),
       "master": (Str(300), False), "seal": (Str(64), False)},
}

# type -> {field: (type, required)}. Add fields; never remove or retype one (a deeper shape of the same
# JSON type is not a new type: it refuses only what no agent sends).
MESSAGES: dict[str, dict[str, tuple[object, bool]]] = {
    # agent -> controller
    "register": {
        "node_id": ("str", True), "agent_version": ("str", True), "address": (Str(500), False),
        "labels": (LABELS, False), "hostname": (Str(500), False),
        "cpu": (CPU, False), "memory": (MEMORY, False), "disk": (DISK, False),
        "gpus": (GPUS, False), "gpus_probed": ("bool", False), "gpu_probe_error": (TEXT, False),
        "engines": (ENGINES, False), "engines_probed": ("bool", False), "shards": (ListOf(Obj(SHARD), 1024), False),
        "doctor": (DOCTOR, False), "weights": (WEIGHTS, False),
        "installable": (MapOf(NAME, VERSION_TEXT, 64), False), "installs": (INSTALLS, False),
        **FABRIC_FACTS, "features": (ListOf(NAME, 64), False),
    },
    "heartbeat": {
        "node_id": ("str", True), "seq": ("int", True), "memory": (MEMORY, False), "load": (LOAD, False),
        "disk": (DISK, False), "gpus": (GPUS, False), "engines": (ENGINES, False),
        "engines_changed": ("bool", False), "weights": (WEIGHTS, False), "installs": (INSTALLS, False),
        **FABRIC_FACTS, "fabrics_changed": ("bool", False),
    },
    "shard_status": {"node_id": ("str", True), **SHARD},
    "ack": {"node_id": ("str", True), "request_id": ("str", True), "ok": ("bool", True), "error": ("str", False)},
    "logs_reply": {"node_id": ("str", True), "request_id": ("str", True), "lines": ("array", False),
                   "sources": ("array", False), "error": ("str", False), "cursor": ("int", False),
                   "skipped": ("bool", False)},
    "weights_reply": {"node_id": ("str", True), "request_id": ("str", True), "weights_dir": ("str", False),
                      "entries": ("int", False), "bytes": ("int", False), "fetched_bytes": ("int", False),
                      "files": ("array", False), "truncated": ("bool", False), "removed": ("array", False),
                      "refused": ("object", False)},
    "fabric_test_reply": {"node_id": ("str", True), "request_id": ("str", True), "gbps": (Num(0, 1e6), False),
                          "error": (TEXT, False), "output": (Str(20000), False)},
    "scan_fabric_reply": {"node_id": ("str", True), "request_id": ("str", True), "output": (Str(15 * 1024 * 1024), False),
                          "error": (TEXT, False)},
    # controller -> agent
    "registered": {"node_id": ("str", True), "heartbeat_interval": ("number", False)},
    "start_shard": {
        "request_id": ("str", True), "shard_id": ("str", True), "model": ("str", True), "engine": ("str", True),
        "source": ("str", True), "args": ("array", False), "env": ("object", False), "gpus": ("array", False),
        "profile_fp": ("str", False), "max_context": ("int", False), "start_limit": (Num(0, 86400), False),
        "group": (NAME, False), "rank": (Int(0, MOST_RANKS - 1), False), "ranks": (Int(1, MOST_RANKS), False),
        "master": (Str(300), False), "fabric": (Str(200), False), "adapters": (ListOf(NAME, 64), False),
        "seal": (Str(64), False),
    },
    "stop_shard": {"request_id": ("str", True), "shard_id": ("str", True)},
    "drain_shard": {"request_id": ("str", True), "shard_id": ("str", True), "timeout": ("number", False)},
    "remove_weights": {"request_id": ("str", True), "source": ("str", True)},
    "logs_request": {"request_id": ("str", True), "source": ("str", False), "lines": ("int", False),
                     "after": ("int", False)},
    "weights_request": {"request_id": ("str", True), "most": ("int", False)},
    "reclaim_weights": {"request_id": ("str", True), "names": ("array", True)},
    "fabric_test": {"request_id": ("str", True), "role": (Str(16), True), "hca": (NAME, True),
                    "port": (Int(0, 255), True), "tcp_port": (Int(0, 65535), True), "seconds": (Int(1, 30), True),
                    "peer": (Str(64), False)},
    "scan_fabric": {"request_id": ("str", True), "hca": (NAME, True), "port": (Int(0, 255), True)},
    "install_engine": {"request_id": ("str", True), "engine": (NAME, True)},
    "heartbeat_ack": {"seq": ("int", True)},
    "register_again": {"reason": ("str", True)},
    "refused": {"reason": ("str", True)},
}

_SCHEMA = Schema(MESSAGES, VERSION, largest=LARGEST, deepest=DEEPEST)
encode = _SCHEMA.encode
decode = _SCHEMA.decode
