"""The accountant: admits and settles requests against every pool that limits them.

There is one accountant for the whole cluster (in the controller), so a limit
holds across any number of gateway workers and processes. A gateway sends the
levels a request is held to (see `limits.Access`); the accountant answers
yes, or which pool refused and when to retry.

The rules, in the order they are checked:

1. Budgets first, every level's, and only when the model has a price. A
   budget refuses once what is spent plus what requests in flight may still
   spend (their estimated cost, reserved at admission) reaches it; the request
   that crosses it is served, so a budget is overspent by at most one
   request, however many run at once. A refusal charges no other pool.
2. Requests a minute: each level charges one as it checks, so two requests
   at once cannot both see the last slot. When a level refuses, what the
   levels before it took is handed back.
3. Tokens a minute: the same, with the estimate; a refusal here hands back
   the tokens but not the request (it did arrive).

An admit may ask for an allowance of up to `grant` requests: the accountant
then charges that many requests, tokens and cost at once (each as many times
the request's own estimate), if every pool has sixteen times as much headroom
left (`SHARE`), and the worker admits its next requests from it without
asking; what it does not use is handed back when it settles the allowance.
Allowances only ever hold what the pools had left, so all workers together
never pass a limit; near a limit there is no room for one and every request is
asked for, so the rules above hold to the request. An allowance is spent
within `accounting.GRANT_SECONDS` of being asked for, so its requests are
counted in the requests-a-minute windows from that time on: a minute that
holds one of them holds the whole allowance.

Settling replaces each token estimate with the real count in every pool that
took it, and adds the cost to every budget. Only the gateway that admitted a
request may settle it, once, with amounts that are not negative; any other
settle is refused and changes nothing, so no peer can refund a budget or spend
another's. After a restart, spend is rebuilt for every scope from the usage
rows of the current day and month; a settle for a reservation made before it
is refused (nobody here can tell who may make it), so what requests in flight
at that moment spend counts from the next restart's rebuild.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time

from sqlalchemy.engine import Engine

from llmgw import rules
from llmgw.people import limits as lim
from llmgw.wire.accounting import GRANT_SECONDS, LARGEST_GRANT

log = logging.getLogger("llmgw.accountant")

WINDOW = 60.0  # seconds: "a minute" is any sixty seconds, not the clock's minute
ADJECTIVE = {"day": "daily", "month": "monthly"}
RESERVATION_TTL = 3600.0  # a reservation never settled (its gateway died) is forgotten after this
# An allowance takes at most a SHARE-th of what any pool it is counted in has left: the allowances of many
# workers then leave most of a limit to be asked for, and none is granted within SHARE requests of one.
SHARE = 16


class Window:
    """A sliding sixty seconds of charges: exact, so a limit of N admits at most N in any minute."""

    __slots__ = ("entries", "total")

    def __init__(self):
        # [time, amount, counted]: counted until expired. An allowance's charge is dated ahead, so the
        # charges after it wait behind it to expire; whether one is still in the total is its flag's to say.
        self.entries: collections.deque[list] = collections.deque()
        self.total = 0

    def _expire(self, now: float) -> None:
        entries = self.entries
        while entries and entries[0][0] <= now - WINDOW:
            entry = entries.popleft()
            self.total -= entry[1]
            entry[2] = False

    def allow(self, limit: int, amount: int, now: float, at: float | None = None) -> list | None:
        """Charge AMOUNT if it fits under LIMIT; the entry (to hand back or settle later), or None.
        An empty window takes any one request, so a single estimate larger than the limit is not
        refused forever. AT dates the charge later than NOW (an allowance spent until then): it counts
        from now until a minute after AT, and the charges after it leave no sooner than it does."""
        self._expire(now)
        if self.total + amount > limit and (self.total > 0 or limit == 0):
            return None
        entry = [now if at is None else at, amount, True]
        self.entries.append(entry)
        self.total += amount
        return entry

    def adjust(self, entry: list, amount: int, now: float) -> None:
        """Make ENTRY count AMOUNT (0 hands it back); it keeps its time."""
        self._expire(now)
        if entry[2]:  # not expired yet, so part of the total
            self.total += amount - entry[1]
        entry[1] = amount

    def used(self, now: float) -> int:
        self._expire(now)
        return self.total

    def left(self, limit: int, now: float) -> int:
        return limit - self.used(now)

    def retry_after(self, now: float) -> int:
        """Seconds until the oldest charge leaves the window."""
        if not self.entries:
            return 1
        return max(1, math.ceil(self.entries[0][0] + WINDOW - now))


@dataclasses.dataclass
class Reservation:
    id: int
    at: float
    tokens: list[tuple[Window, list]]  # each token pool's entry, settled to the real count
    budgets: list[tuple[str, str, float]]  # (counter, period, period start) of every level with a budget
    cost: int  # the estimated cost held in each budget's reserve until settled
    owner: object = None  # who admitted it, and so the only one who may settle it
    size: int = 1  # the requests it admits: more than one for a worker's allowance
    # An allowance's request windows, settled to its use; or a request's that may be handed back (`admit`'s UNDO).
    requests: list[tuple[Window, list]] = dataclasses.field(default_factory=list)

    @property
    def held(self) -> bool:
        """Whether it waits for a settle: it took tokens, reserved a budget's cost, is an allowance, or may be
        handed back."""
        return bool(self.tokens or self.budgets or self.size > 1 or self.requests)


@dataclasses.dataclass(frozen=True)
class Refused:
    limit: str  # budget, rpm, tpm
    counter: str
    retry_after: int
    message: str


class Accountant:
    def __init__(self, clock=time.time):
        self.clock = clock
        self.requests: dict[str, Window] = collections.defaultdict(Window)
        self.tokens: dict[str, Window] = collections.defaultdict(Window)
        self.spend: dict[tuple[str, str, float], int] = collections.defaultdict(int)
        self.reserved: dict[tuple[str, str, float], int] = collections.defaultdict(int)
        self.reservations: dict[int, Reservation] = {}
        # Each period's current start and the next one's: worked out again only when the clock leaves it (a
        # calendar sum per level was a sixth of what an admission cost).
        self.periods: dict[str, tuple[float, float]] = {}
        # Random, not 1: a settle meant for another accountant (one of an earlier term of this controller, at
        # the same address) must not find a reservation of this one under the same id.
        self.next_id = int.from_bytes(os.urandom(5), "big") + 1

    def _start(self, period: str, now: float) -> float:
        """The start of NOW's PERIOD (rules.period_start), remembered until the next one's."""
        held = self.periods.get(period)
        if held is None or not held[0] <= now < held[1]:
            held = self.periods[period] = _bounds(period, now)
        return held[0]

    def spent(self, counter: str, period: str, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        return self.spend.get((counter, period, self._start(period, now)), 0)

    def admit(self, levels: list[list], priced: bool, estimate: int, cost: int = 0,
              owner: object = None, grant: int = 1, undo: bool = False) -> Reservation | Refused:
        """Check LEVELS ([counter, rpm, tpm, budget, period] each) for one request of ESTIMATE tokens
        that may cost up to COST micro-units; only OWNER may settle what it reserves. With GRANT above
        one, the reservation may be an allowance for up to GRANT such requests (its `size`). With UNDO, a
        settle with `requests` 0 hands back the request it counted: the request is held in another part
        too (llmgw/gateway/limiter.py), which may refuse it."""
        now = self.clock()
        budgets = [(counter, period, self._start(period, now))
                   for counter, _r, _t, budget, period in levels if budget is not None]
        if priced:
            for pool, budget in zip(budgets, (level[3] for level in levels if level[3] is not None)):
                counter, period, _start = pool
                if self.spend.get(pool, 0) + self.reserved.get(pool, 0) >= budget:
                    return Refused("budget", counter, _until_next(period, now),
                                   f"the {ADJECTIVE.get(period, period)} budget of {_scope_words(counter)} is spent")
        size = self._allowance(levels, priced, estimate, cost, min(grant, LARGEST_GRANT), now) if grant > 1 else 1
        at = now + GRANT_SECONDS if size > 1 else None
        taken: list[tuple[Window, list]] = []
        for counter, rpm, _tpm, _budget, _period in levels:
            if rpm is None:
                continue
            window = self.requests[counter]
            entry = window.allow(rpm, size, now, at)
            if entry is None:
                _hand_back(taken, now)
                return Refused("rpm", counter, window.retry_after(now),
                               f"{_scope_words(counter)} may make {rpm} requests a minute")
            taken.append((window, entry))
        tokens: list[tuple[Window, list]] = []
        for counter, _rpm, tpm, _budget, _period in levels:
            if tpm is None:
                continue
            window = self.tokens[counter]
            entry = window.allow(tpm, estimate * size, now, at)
            if entry is None:
                _hand_back(tokens, now)
                return Refused("tpm", counter, window.retry_after(now),
                               f"{_scope_words(counter)} may use {tpm} tokens a minute")
            tokens.append((window, entry))
        reservation = Reservation(self.next_id, now, tokens, budgets, cost * size if priced else 0, owner, size,
                                  taken if size > 1 or undo else [])
        self.next_id += 1
        for pool in budgets:
            self.reserved[pool] += reservation.cost
        if reservation.held:
            self.reservations[reservation.id] = reservation
        return reservation

    def _allowance(self, levels: list[list], priced: bool, estimate: int, cost: int, want: int,
                   now: float) -> int:
        """How many requests like this one an allowance may hold: up to WANT, and a SHARE-th of what every
        pool has left; 1 (no allowance) when that is fewer than two."""
        size = want
        for counter, rpm, tpm, budget, period in levels:
            if rpm is not None:
                size = min(size, self.requests[counter].left(rpm, now) // SHARE)
            if tpm is not None:  # a window already past its limit (tokens beyond estimates) grants none
                size = min(size, self.tokens[counter].left(tpm, now) // (SHARE * max(estimate, 1)))
            if budget is not None and priced and cost:
                pool = (counter, period, self._start(period, now))
                size = min(size, (budget - self.spend.get(pool, 0) - self.reserved.get(pool, 0)) // (SHARE * cost))
        return size if size > 1 else 1

    def settle(self, reservation_id: int, tokens: int, cost: int, owner: object = None,
               requests: int | None = None) -> str | None:
        """The request is over: TOKENS were used and it cost COST micro-units (an allowance: its REQUESTS
        together). None when settled; else why it was refused, with nothing changed."""
        if tokens < 0 or cost < 0:
            return f"a settle of {tokens} tokens and cost {cost}: neither may be negative"
        reservation = self.reservations.get(reservation_id)
        if reservation is None:
            return (f"reservation {reservation_id} is not held here (never admitted, already settled, made "
                    "before a restart, or forgotten after an hour)")
        if reservation.owner != owner:
            return f"reservation {reservation_id} was admitted by another gateway, which alone may settle it"
        if (reservation.size > 1 and requests is None) or (requests is not None and not 0 <= requests <= reservation.size):
            return (f"reservation {reservation_id} holds {reservation.size} request(s), settled as "
                    f"{requests}: say how many of them were used")
        del self.reservations[reservation_id]
        now = self.clock()
        if requests is not None:  # an allowance's request windows, or a request's admitted to be handed back
            for window, entry in reservation.requests:
                window.adjust(entry, requests, now)
        for window, entry in reservation.tokens:
            window.adjust(entry, tokens, now)
        self._release(reservation)
        if cost:
            for pool in reservation.budgets:
                self.spend[pool] += cost
        return None

    def _release(self, reservation: Reservation) -> None:
        for pool in reservation.budgets:
            left = self.reserved[pool] - reservation.cost
            if left > 0:
                self.reserved[pool] = left
            else:
                self.reserved.pop(pool, None)

    def status(self, levels: list[list]) -> dict[str, tuple[int, int]]:
        """What a key is told: for each kind of limit, (limit, remaining) of the pool nearest to
        refusing, which is the fullest pool rather than the smallest number."""
        now = self.clock()
        out: dict[str, tuple[int, int]] = {}
        for counter, rpm, tpm, budget, period in levels:
            for name, limit in (("rpm", rpm), ("tpm", tpm), ("budget", budget)):
                if limit is None:
                    continue
                if name == "budget":
                    used = self.spent(counter, period, now)
                else:
                    window = (self.requests if name == "rpm" else self.tokens).get(counter)
                    used = window.used(now) if window else 0
                remaining = max(0, limit - used)
                # Compare shares left (remaining / limit) without division.
                if name not in out or remaining * out[name][0] < out[name][1] * limit:
                    out[name] = (limit, remaining)
        return out

    def forget_stale(self) -> int:
        cutoff = self.clock() - RESERVATION_TTL
        stale = [rid for rid, r in self.reservations.items() if r.at < cutoff]
        for rid in stale:
            self._release(self.reservations.pop(rid))
        return len(stale)

    def restore(self, engine: Engine, part: int = 0, parts: int = 1) -> int:
        """Rebuild the spend of every scope for today and this month from the usage roll-ups (and the
        rows not yet rolled up), so a restart costs the same over a quiet month or a busy one. Of PARTS
        accountants, this is PART: it rebuilds the pools whose home (`rules.part_of`) is its own."""
        from llmgw.people import rollup

        now = self.clock()
        restored = 0
        with engine.connect() as conn:
            ruleset = lim.read_rules(conn)
            for period in rules.PERIODS:
                start = rules.period_start(period, now)
                for key_id, project_id, user_id, cost in rollup.spend_since(conn, start):
                    # The chat page's rows carry "session:<person>" and spend as that person.
                    key = key_id if key_id and not key_id.startswith("session:") else None
                    scopes = ruleset.scopes_of(key, project_id, user_id)
                    tree, person = ruleset.homes(key, project_id, user_id)
                    counters = [(c, person if scope in rules.PERSON_SCOPES else tree) for scope, _sid, c in scopes]
                    if scopes:  # the cluster's default budget, if one binds, in the pool `Rules.access` counts it in
                        counters.append((ruleset.default_pool(scopes), person))
                    for counter, home in counters:
                        if rules.part_of(home, parts) == part:
                            self.spend[(counter, period, start)] += int(cost)
                    restored += 1
        log.info("rebuilt budgets from %d groups of usage rows for today and this month", restored)
        return restored


def _hand_back(taken: list[tuple[Window, list]], now: float) -> None:
    for window, entry in taken:
        window.adjust(entry, 0, now)


def _bounds(period: str, now: float) -> tuple[float, float]:
    """The start of NOW's PERIOD and of the next."""
    start = rules.period_start(period, now)
    return start, rules.period_start(period, start + (86400 * 1.5 if period == "day" else 86400 * 32))


def _until_next(period: str, now: float) -> int:
    return max(1, math.ceil(_bounds(period, now)[1] - now))


def _scope_words(counter: str) -> str:
    scope, _, rest = counter.partition(":")
    words = {"key": "this key", "user": "this person", "project": "this project", "team": "this team",
             "org": "this organisation", "project_member": "each member of this project",
             "team_member": "each member of this team", "org_member": "each member of this organisation",
             "personal": "your use on your own (personal keys and the chat page)",
             "default": "a key without limits of its own (the cluster's default)"}
    return words.get(scope, counter)
