"""The keys one gateway worker knows, in memory: a request is authenticated with one hash and one lookup.

The table is built whole from a `keys` message (llmgw.wire.gateways): pushed
by the controller when a gateway follows one, or read from the store by a
gateway without one. A `key_changes` message makes the next table from the
one held, changing only what changed. Either way it is replaced whole, never
changed in place, so a lookup never sees half a table. Expiry is checked
against the clock at each request, so an expired key needs no new table to
stop working.

Besides the keys it holds the rules they are resolved by (limits, tree,
prices), so the chat page's people are resolved from the same moment's rules.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

from llmgw import rules
from llmgw.principals import KeyRecord, hash_secret, well_formed
from llmgw.wire import keychanges

log = logging.getLogger("llmgw.gateway")


def _record(entry: dict) -> KeyRecord:
    """A key as a `keys` or `key_changes` message carries it (its hash besides). The project and the owner are
    the same for many keys: interned, each is one string in the worker rather than one a key (a fifth of a
    table's memory)."""
    project_id, user_id = entry["project_id"], entry["user_id"]
    return KeyRecord(entry["id"], entry["name"], project_id and sys.intern(project_id), sys.intern(entry["project"]),
                     entry["prefix"], entry["created_at"], entry["expires_at"], entry["revoked_at"],
                     user_id and sys.intern(user_id))


def _limits(values) -> rules.Limits:
    """(rpm, tpm, budget, period, models, band, disabled, profile) as the rules hold them."""
    rpm, tpm, budget, period, models, band, disabled, profile = values
    return rules.Limits(rpm, tpm, budget, period, tuple(models) if models is not None else None, band, disabled,
                        profile)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a key was not accepted, in words for the client."""
    message: str
    code: str


MISSING = Refusal("No API key was given. Send it as `Authorization: Bearer sk-llmgw-...`; "
                  "an operator makes one with `llmgw keys create NAME`.", "missing_api_key")
UNKNOWN = Refusal("This API key is not known here. Check that it was copied whole; "
                  "an operator can list keys with `llmgw keys list`.", "invalid_api_key")
# A key of the shape llmgw makes that this table does not hold: it may have been made a moment ago, and be
# on its way to this worker (llmgw/gateway/worker.py, Runtime.newer_keys).
NOT_YET = dataclasses.replace(UNKNOWN)


class KeyTable:
    def __init__(self, records: dict[str, KeyRecord], revision: int, ruleset: rules.Rules | None = None,
                 prices: rules.Prices | None = None, suspended: frozenset[str] = frozenset(),
                 active_people: frozenset[str] = frozenset(), admins: frozenset[str] = frozenset(),
                 threads: dict[str, float] | None = None, memory: dict[str, float] | None = None):
        self.by_hash = records
        self.revision = revision  # the store's key revision it was read at
        self.rules = ruleset or rules.Rules({}, {}, {})
        self.prices = prices or rules.Prices({})
        self.suspended = suspended
        self.active_people = active_people  # who may use the chat page
        self.admins = admins  # active administrators: their keys may choose a replica (llmgw ctl bench)
        self.threads = threads or {}  # hours each project keeps its conversations, for those that do
        self.memory = memory or {}  # hours each project keeps its agents' notes, for those that do
        # Each key's and person's access, worked out at its first request: at a million keys, working all of them
        # out when a table arrives took seconds, and most keys are not used between two changes.
        self.keys_access: dict[str, rules.Access] = {}
        self.people: dict[str, rules.Access] = {}

    @classmethod
    def from_message(cls, message: dict) -> "KeyTable":
        """The table a `keys` message describes (checked already by its schema)."""
        records = {entry["hash"]: _record(entry) for entry in message["keys"]}
        limits = {identity: _limits(values) for identity, values in keychanges.limits_of(message).items()}
        ruleset = rules.Rules(limits, {p: tuple(up) for p, up in message["parents"].items()}, message["team_org"])
        prices = rules.Prices({model: rules.Price(i, o) for model, i, o in message["prices"]})
        return cls(records, message["revision"], ruleset, prices, frozenset(message["suspended"]),
                   frozenset(message["active"]), frozenset(message.get("admins", ())),
                   {project: hours for project, hours in message.get("threads", ())},
                   {project: hours for project, hours in message.get("memory", ())})

    def changed(self, message: dict) -> "KeyTable":
        """The table a `key_changes` message makes of this one (whose revision is its `base`). A new table, as
        for a whole set, so a request never sees half a change; the parts that did not change are shared,
        and those that did are copied (a C copy of a dictionary: milliseconds at a million keys) and changed
        entry by entry."""
        def changed_part(part: dict, entries_of: str, entry) -> dict:
            if entries_of not in message and f"{entries_of}_gone" not in message:
                return part
            out = dict(part)
            for identity in message.get(f"{entries_of}_gone", ()):
                out.pop(tuple(identity) if isinstance(identity, list) else identity, None)
            out.update(entry(e) for e in message.get(entries_of, ()))
            return out

        def changed_set(part: frozenset, name: str) -> frozenset:
            return (part - frozenset(message.get(f"{name}_gone", ()))) | frozenset(message.get(name, ()))

        records = changed_part(self.by_hash, "keys", lambda e: (e["hash"], _record(e)))
        limits = changed_part(self.rules.limits, "limits", lambda row: ((row[0], row[1]), _limits(row[2:])))
        parents = changed_part(self.rules.parents, "parents", lambda row: (row[0], (row[1], row[2])))
        team_org = changed_part(self.rules.team_org, "team_org", lambda row: (row[0], row[1]))
        by_model = changed_part(self.prices.by_model, "prices", lambda row: (row[0], rules.Price(row[1], row[2])))
        same_rules = limits is self.rules.limits and parents is self.rules.parents and team_org is self.rules.team_org
        table = KeyTable(records, message["revision"],
                         self.rules if same_rules else rules.Rules(limits, parents, team_org),
                         self.prices if by_model is self.prices.by_model else rules.Prices(by_model),
                         changed_set(self.suspended, "suspended"), changed_set(self.active_people, "active"),
                         changed_set(self.admins, "admins"),
                         changed_part(self.threads, "threads", tuple), changed_part(self.memory, "memory", tuple))
        if same_rules:
            # What was worked out still holds, but for the keys that changed (a key's project is part of it).
            table.keys_access = dict(self.keys_access)
            for entry in message.get("keys", ()):
                table.keys_access.pop(entry["id"], None)
            for gone in message.get("keys_gone", ()):
                if gone in self.by_hash:
                    table.keys_access.pop(self.by_hash[gone].id, None)
            table.people = self.people
        return table

    def access(self, record: KeyRecord) -> rules.Access:
        """The levels, allowlist, band and profile a request with the key RECORD is held to."""
        found = self.keys_access.get(record.id)
        if found is None:
            found = self.keys_access[record.id] = self.rules.access(record.id, record.project_id, record.user_id)
        return found

    def newer(self, other: "KeyTable") -> bool:
        """Whether OTHER should replace this table: read at a later revision of the store's keys. Whichever
        controller pushed it: the revision is the shared store's, so it orders the pushes of every controller
        and every start. Taking the first table of a new controller epoch whatever its revision let a leader
        woken from a pause push the keys it had before a revocation, and the revoked key worked again."""
        return other.revision > self.revision

    def person(self, user_id: str) -> rules.Access:
        """The access of a signed-in person using the chat page (no key: they spend as themselves)."""
        found = self.people.get(user_id)
        if found is None:
            found = self.people[user_id] = self.rules.access(None, None, user_id)
        return found

    def authenticate(self, authorization: str | None, now: float) -> KeyRecord | Refusal:
        if not authorization:
            return MISSING
        scheme, _, secret = authorization.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            return Refusal("The Authorization header must be `Bearer <key>`.", "invalid_api_key")
        record = self.by_hash.get(hash_secret(secret.strip()))
        if record is None:
            return NOT_YET if well_formed(secret.strip()) else UNKNOWN
        if record.revoked_at is not None:
            return Refusal(f"This API key ({record.prefix}...) was revoked. Ask an operator for a new one.",
                           "revoked_api_key")
        if record.expires_at is not None and now >= record.expires_at:
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(record.expires_at))
            return Refusal(f"This API key ({record.prefix}...) expired at {when}. Ask an operator for a new one.",
                           "expired_api_key")
        if record.user_id in self.suspended:
            return Refusal(f"This API key ({record.prefix}...) belongs to an account that is suspended or "
                           "waiting for approval. Ask an operator.", "account_inactive")
        return record


class HeldKeys:
    """The table a gateway process holds, and how it takes the controller's `keys` and `key_changes` (the worker's
    and the master's, which keeps one for the workers it forks).

    Changes are applied, and a whole set at the revision held dropped unread, only to a trusted table: one
    read at one moment of the store (a worker's own read at its start, `people.keys.key_set`), or a whole set
    of the controller's, which is read so too. Two such reads labelled with one revision hold the same keys,
    since every change moves the revision in its own transaction. A table kept over a set of a lower revision
    (the store went back: restored from a backup) is no longer trusted: until then every whole set is read,
    and one at or above the revision held replaces the table. A worker's own read used to wait for a whole
    set as well: at a million keys that was a 23 s read in each worker, each behind a 7 s encode, and a key
    made after the gateway started worked only after 98 s.

    A table read here is ahead of what the controller published during the read, which the worker's socket
    holds for it (subscribed first): until that has been read (`caught_up`), or the controller is heard at or
    past the revision read, a set below it is passed over, not taken for a store gone back. Past that, one is
    a store gone back, as for any table."""

    def __init__(self, table: KeyTable, say: bool = True, trusted: bool = False, read_here: bool = False):
        """SAY: log a set kept over an older one (the workers do; their master, which keeps the same, does not).
        TRUSTED: TABLE was taken from the controller and trusted since; READ_HERE: it is this process's own
        read of the store, at one moment."""
        self.table = table
        self.say = say
        self.trusted = trusted or read_here
        self.behind = read_here  # what was published during the read here not yet all read
        self.older: set[int] = set()  # revisions of sets below the one held, each said once

    @classmethod
    def at_start(cls, own: KeyTable, masters: tuple[KeyTable, bool] | None) -> "HeldKeys":
        """A worker's keys as it starts: OWN, its read of the store, or its master's table (MASTERS: with whether
        the master trusts it) where that is newer, trusted as the master trusts it."""
        if masters is not None and own.newer(masters[0]):
            return cls(masters[0], trusted=masters[1])
        return cls(own, read_here=True)

    def caught_up(self) -> None:
        """What was published while this process read its table has been read."""
        self.behind = False

    def holds(self, revision: int | None) -> bool:
        """Whether a whole set at REVISION (None: not known before it is read) is to be dropped unread: it is at
        the revision held, once trusted, or below one read here that the controller has not caught up with."""
        if revision is None or not self.trusted:
            return False
        if revision >= self.table.revision:
            self.behind = False
            return revision == self.table.revision
        return self.behind

    def whole(self, message: dict) -> KeyTable | None:
        """The table a `keys` message makes, or None where the one held stays."""
        revision = message["revision"]
        if self.holds(revision):
            return None
        if revision > self.table.revision or (revision == self.table.revision and not self.trusted):
            self.table, self.trusted = KeyTable.from_message(message), True
            return self.table
        if revision < self.table.revision:
            # A leader woken from a pause pushes its old keys once or twice; a store restored from a backup has
            # its revision go back for good. Either way, the next set at or above the one held is read whole.
            self.trusted = False
            if self.say and revision not in self.older:
                self.older.add(revision)
                log.warning("kept the keys at revision %d over a controller's keys at revision %d. If the store was "
                            "restored from a backup, restart this gateway: until the store's revision is back at "
                            "%d no key revoked since is refused here", self.table.revision, revision,
                            self.table.revision)
        return None

    def changes(self, message: dict) -> KeyTable | None:
        """The table a `key_changes` message makes of the one held, or None where it does not apply (the whole
        set that follows it is then read)."""
        if message["revision"] >= self.table.revision:
            self.behind = False
        if self.trusted and message["base"] == self.table.revision and message["revision"] > message["base"]:
            self.table = self.table.changed(message)
            return self.table
        return None
