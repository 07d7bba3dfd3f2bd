"""The messages between the controller and gateways: routing snapshots and keys pushed out, demand sent back.

The controller's PUB carries four topics. `snapshot` is the whole routing
view (models, aliases, ready replicas, where demand and the accountant are),
sent on change and every couple of seconds. `leading` is where demand and
the accountant are, alone: a controller that has just come to lead sends it
while it waits for its nodes, so gateways ask its accountant at once and keep
routing with the replicas they have (a snapshot without replicas would empty
their routing, and gateways of the first version, which do not subscribe to
`leading`, never see it). `keys` is every API key with the
limits, tree and prices it is resolved by, sent after the store's key revision
changes and again every `KEYS_REPEAT` seconds (less often for a large set), so
a missed message heals; `key_changes` is what changed, sent at once, so revoking
a key reaches every worker within a second. Each carries the
publisher's `epoch` (one per controller start) so a gateway takes a restarted
controller's first message whatever its counter; the channel is CURVE, so
only the controller can start an epoch. Gateway workers PUSH `demand` and
`used` notes back. `docs/protocol.md` describes every message; a test keeps
that page and `MESSAGES` in step.
"""

from __future__ import annotations

import re

from llmgw import modelnames, rules
from llmgw.wire.schema import Int, ListOf, Nullable, Num, Obj, ProtocolError, Row, Schema, Str

__all__ = ["MESSAGES", "VERSION", "ProtocolError", "decode", "encode", "SNAPSHOT", "KEYS", "KEY_CHANGES", "LEADING",
           "KEYS_REPEAT", "keys_revision", "snapshot_version",
           "MAX_IN_FLIGHT"]

VERSION = 1
SNAPSHOT = b"snapshot"  # PUB topics
KEYS = b"keys"
KEY_CHANGES = b"key_changes"  # "keys" is no prefix of it, so a gateway of the version before never receives it
LEADING = b"leading"  # no prefix of the others: a SUB's topic is a prefix, and no older gateway asks for it
KEYS_REPEAT = 10.0  # seconds: keys can be many, so they are repeated less often than snapshots
MAX_IN_FLIGHT = 100_000  # a replica's measured limit of requests at once: more than any engine runs

COUNT = Int(0, 2**53)
NAME = Str(200)
PORT = Nullable(Int(1, 65535))
SECONDS = Nullable("number")
# The catalog's own bounds (llmgw/modelnames.py), so the controller never sends what a gateway refuses.
MODEL_NAME = Str(modelnames.LONGEST)
MODEL = Obj({"name": (MODEL_NAME, True), "aliases": (ListOf(MODEL_NAME, modelnames.MOST_ALIASES), False),
             "description": ("str", False),
             "max_context": (Nullable(COUNT), False), "max_output": (Nullable(COUNT), False),
             "on_demand": ("bool", False), "stopped": ("bool", False), "role": (Str(20), False),
             # No replica ready: the one nearest to serving, its state and a download's bytes.
             "loading": (Obj({"state": (Str(20), True), "bytes_done": (COUNT, False), "bytes_total": (COUNT, False)}),
                         False),
             "guard": (Obj({"model": (NAME, False), "check": (Str(10), False), "fail": (Str(10), False),
                            # a judge's own: its prompt's format, and the categories it is asked about
                            "format": (Str(20), False),
                            "categories": (ListOf(Str(modelnames.LONGEST_CATEGORY), modelnames.MOST_CATEGORIES), False)}),
                       False),
             "routing_profile": (Str(64), False)})
REPLICA = Obj({"id": (NAME, True), "url": (Str(2000), True), "models": (ListOf(NAME, 100), True),
               "weight": ("number", False), "api_key": (Str(200), False),
               "max_in_flight": (Int(1, MAX_IN_FLIGHT), False), "address": (Str(100), False)})
KEY = Obj({"hash": (Str(64), True), "id": (NAME, True), "name": ("str", True), "project_id": (Nullable(NAME), True),
           "project": ("str", True), "prefix": (Str(40), True), "created_at": ("number", True),
           "expires_at": (SECONDS, True), "revoked_at": (SECONDS, True), "user_id": (Nullable(NAME), True)})
LIMIT = Nullable(COUNT)
LIMIT_VALUES = (LIMIT, LIMIT, LIMIT, Nullable(Str(8, rules.PERIODS)), Nullable(ListOf(NAME, 10_000)),
                Nullable(Str(8, rules.BANDS)))
# Every scope but `personal`, which a gateway of the version before does not know (it travels on its own).
LIMITS = Row((Str(20, tuple(s for s in rules.SCOPES if s != "personal")), Str(500), *LIMIT_VALUES))
MANY = 10_000_000
PARTS = 64  # the accountant's parts at most
SCOPE_ID = Row((Str(20, rules.SCOPES), Str(500)))
HOURS = Num(0, 24 * 3653)

# type -> {field: (type, required)}. Add fields; never remove or retype one.
MESSAGES: dict[str, dict[str, tuple[object, bool]]] = {
    # controller -> gateways
    "snapshot": {"epoch": (Str(64), True), "version": (COUNT, True), "models": (ListOf(MODEL, MANY), True),
                 "replicas": (ListOf(REPLICA, MANY), True), "demand_port": (PORT, False),
                 "accountant_port": (PORT, False), "unhealthy": (ListOf(NAME, MANY), False),
                 # The accountant's parts (llmgw/control/accountparts.py), when there are several: the first
                 # is `accountant_port`, which a gateway of the version before asks alone.
                 "accountant_ports": (ListOf(PORT, PARTS), False)},
    "leading": {"epoch": (Str(64), True), "demand_port": (PORT, False), "accountant_port": (PORT, False),
                "accountant_ports": (ListOf(PORT, PARTS), False)},
    "keys": {"epoch": (Str(64), True), "revision": (COUNT, True), "keys": (ListOf(KEY, MANY), True),
             "limits": (ListOf(LIMITS, MANY), True), "parents": ("object", True), "team_org": ("object", True),
             "prices": (ListOf(Row((NAME, COUNT, COUNT)), MANY), True), "suspended": (ListOf(NAME, MANY), True),
             "active": (ListOf(NAME, MANY), True), "admins": (ListOf(NAME, MANY), False),
             # [project id, hours]: the projects that keep their conversations (llmgw/conversations.py).
             "threads": (ListOf(Row((NAME, HOURS)), MANY), False),
             # [project id, hours]: the projects that keep their agents' notes (llmgw/memory.py).
             "memory": (ListOf(Row((NAME, HOURS)), MANY), False),
             # Personal use's limits (rpm, tpm, budget, period, models, band) and whether it is turned off.
             "personal": (Row((*LIMIT_VALUES, "bool")), False),
             # [scope, scope id, name]: the routing profiles set on keys and the tree (llmgw/gateway/routingprofiles.py).
             "profiles": (ListOf(Row((Str(20, rules.SCOPES), Str(500), Str(64))), MANY), False)},
    # What changed from the set at revision `base` to the one at `revision` (llmgw/wire/keychanges.py): each
    # part's new or changed entries, and PART_gone, the identities no longer there. Sent before the whole set.
    "key_changes": {"epoch": (Str(64), True), "base": (COUNT, True), "revision": (COUNT, True),
                    "keys": (ListOf(KEY, MANY), False), "keys_gone": (ListOf(Str(64), MANY), False),
                    # [scope, scope id, rpm, tpm, budget, period, models, band, disabled, profile]
                    "limits": (ListOf(Row((Str(20, rules.SCOPES), Str(500), *LIMIT_VALUES, Nullable("bool"),
                                           Nullable(Str(64)))), MANY), False),
                    "limits_gone": (ListOf(SCOPE_ID, MANY), False),
                    "parents": (ListOf(Row((NAME, NAME, NAME)), MANY), False),  # [project, team, organisation]
                    "parents_gone": (ListOf(NAME, MANY), False),
                    "team_org": (ListOf(Row((NAME, NAME)), MANY), False), "team_org_gone": (ListOf(NAME, MANY), False),
                    "prices": (ListOf(Row((NAME, COUNT, COUNT)), MANY), False),
                    "prices_gone": (ListOf(NAME, MANY), False),
                    "threads": (ListOf(Row((NAME, HOURS)), MANY), False), "threads_gone": (ListOf(NAME, MANY), False),
                    "memory": (ListOf(Row((NAME, HOURS)), MANY), False), "memory_gone": (ListOf(NAME, MANY), False),
                    **{f"{people}{gone}": (ListOf(NAME, MANY), False)
                       for people in ("suspended", "active", "admins") for gone in ("", "_gone")}},
    # gateway workers -> controller
    "demand": {"model": (NAME, True)},
    "used": {"model": (NAME, True)},
}

_SCHEMA = Schema(MESSAGES, VERSION, reads=frozenset({VERSION}))
encode = _SCHEMA.encode
decode = _SCHEMA.decode

# How the controller begins a `keys` message (encode writes the kind, then the fields in the order given, and
# people.keys.key_set puts the revision first).
_KEYS_HEAD = re.compile(rb'\{"v":%d,"type":"keys","epoch":"[^"\\]{0,64}","revision":(\d{1,16})[,}]' % VERSION)


# How the controller begins a `snapshot` message (publisher.Publisher.publish gives the epoch, then the version).
_SNAPSHOT_HEAD = re.compile(rb'\{"v":%d,"type":"snapshot","epoch":"([^"\\]{0,64})","version":(\d{1,16})[,}]' % VERSION)


def snapshot_version(data) -> tuple[str, int] | None:
    """The epoch and version of an encoded `snapshot` message, read from its first bytes alone; None when it
    does not begin as this llmgw's controller writes one. The controller repeats its snapshot every two
    seconds, and reading 20,000 replicas' worth stops a worker for a tenth of a second, so a worker drops
    unread a snapshot of the epoch it holds and a version it has."""
    found = _SNAPSHOT_HEAD.match(bytes(data[:200]))
    return (found.group(1).decode(), int(found.group(2))) if found else None


def keys_revision(data) -> int | None:
    """The revision of an encoded `keys` message (bytes or a buffer), read from its first bytes alone; None
    when it does not begin as this llmgw's controller writes one. A gateway that holds that revision drops
    the message unread: the whole set is repeated every KEYS_REPEAT seconds, and reading a million keys
    stops a worker for seconds, so a worker must not read what it has."""
    found = _KEYS_HEAD.match(bytes(data[:200]))
    return int(found.group(1)) if found else None
