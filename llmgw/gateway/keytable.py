"""The keys one gateway worker knows, in memory: a request is authenticated with one hash and one lookup.

The table is built whole from a `keys` message (llmgw.wire.gateways): pushed
by the controller when a gateway follows one, or read from the store by a
gateway without one. It is replaced whole, never changed in place, so a
lookup never sees half a table. Expiry is checked against the clock at each
request, so an expired key needs no new table to stop working.

Besides the keys it holds the rules they are resolved by (limits, tree,
prices), so the chat page's people are resolved from the same moment's rules.
"""

from __future__ import annotations

import dataclasses
import time

from llmgw import rules
from llmgw.principals import KeyRecord, hash_secret, well_formed


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
        self.access = {r.id: self.rules.access(r.id, r.project_id, r.user_id) for r in records.values()}
        self.people: dict[str, rules.Access] = {}

    @classmethod
    def from_message(cls, message: dict) -> "KeyTable":
        """The table a `keys` message describes (checked already by its schema)."""
        records = {}
        for entry in message["keys"]:
            fields = dict(entry)
            records[fields.pop("hash")] = KeyRecord(**{f.name: fields.get(f.name) for f in
                                                       dataclasses.fields(KeyRecord)})
        limits = {(scope, sid): rules.Limits(rpm, tpm, budget, period, tuple(models) if models is not None else None,
                                             band)
                  for scope, sid, rpm, tpm, budget, period, models, band in message["limits"]}
        for scope, sid, profile in message.get("profiles", ()):
            limits[scope, sid] = dataclasses.replace(limits.get((scope, sid), rules.Limits()), profile=profile)
        if "personal" in message:
            rpm, tpm, budget, period, models, band, disabled = message["personal"]
            limits["personal", ""] = rules.Limits(rpm, tpm, budget, period,
                                                  tuple(models) if models is not None else None, band, disabled or None,
                                                  limits.get(("personal", ""), rules.Limits()).profile)
        ruleset = rules.Rules(limits, {p: tuple(up) for p, up in message["parents"].items()}, message["team_org"])
        prices = rules.Prices({model: rules.Price(i, o) for model, i, o in message["prices"]})
        return cls(records, message["revision"], ruleset, prices, frozenset(message["suspended"]),
                   frozenset(message["active"]), frozenset(message.get("admins", ())),
                   {project: hours for project, hours in message.get("threads", ())},
                   {project: hours for project, hours in message.get("memory", ())})

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
