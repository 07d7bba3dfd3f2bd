"""The rules of limits, prices and admission bands, as pure values: no store, no I/O.

A limit is set on one scope: the cluster (defaults), an organisation, team or
project, each member of one of those, a person, or a key. A request is held to
every level that applies to it at once, each counted in its own pool, so a
team's budget is one pool for all its keys and a per-member limit one pool per
member. `Rules` turns what is set into an `Access` per key: the levels with
their counters, the model allowlist (the intersection of every level's) and
the admission band. Gateways hold these in memory; the accountant counts.

Money is kept in integer micro-units (a millionth of a unit). Prices are per
million tokens; budgets are entered in whole units. Without any price every
request costs nothing and a budget never binds, which the pages say.

Every process uses these rules (the gateway admits by them, the controller's
accountant counts by them, the pages show them); `llmgw.people.limits` reads
and writes them in the store.
"""

from __future__ import annotations

import calendar
import dataclasses
import math
import time
import zlib
from decimal import Decimal, InvalidOperation

MICROS = 1_000_000
TREE_SCOPES = ("org", "team", "project")
MEMBER_SCOPES = tuple(f"{s}_member" for s in TREE_SCOPES)
# `personal` is personal use: a person's keys of no project and their chat on their own, one pool a person.
SCOPES = ("cluster", "personal") + TREE_SCOPES + MEMBER_SCOPES + ("user", "key")
PERSON_SCOPES = ("personal", "user")  # a person's own pools, whichever organisation their request is for
PERIODS = ("day", "month")
BANDS = ("high", "normal", "low")  # the order requests are let through when replicas are saturated
DEFAULT_BAND = "normal"
FIELDS = ("rpm", "tpm", "budget", "period", "models", "band", "disabled", "profile")


class LimitError(Exception):
    """A limit or price that cannot be set as asked; the message says what is allowed."""


@dataclasses.dataclass(frozen=True, slots=True)  # slots: a key may have its own, a million in every gateway worker
class Limits:
    """What one scope sets; None is "not set here"."""
    rpm: int | None = None
    tpm: int | None = None
    budget: int | None = None  # micro-units
    period: str | None = None
    models: tuple[str, ...] | None = None
    band: str | None = None
    disabled: bool | None = None  # personal use turned off (set on the `personal` scope only)
    profile: str | None = None  # the routing profile (a gateway's [[routing_profiles]] entry) requests go by

    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in FIELDS)


@dataclasses.dataclass(frozen=True)
class Level:
    """One pool a request is counted in."""
    counter: str  # "team:<id>", "project_member:<project id>/<user id>", ...
    rpm: int | None
    tpm: int | None
    budget: int | None
    period: str
    home: str = ""  # which accountant part counts it (`part_of`): its organisation's id, or its person's

    def wire(self) -> list:
        return [self.counter, self.rpm, self.tpm, self.budget, self.period]


def part_of(home: str, parts: int) -> int:
    """The accountant part (of PARTS) that counts the pools of HOME: the same in every process, so a gateway
    asks the part that holds a pool and that part alone rebuilds its spend (`Accountant.restore`)."""
    return zlib.crc32(home.encode()) % parts if parts > 1 else 0


@dataclasses.dataclass(frozen=True)
class Access:
    """Everything a gateway needs to admit one principal's requests."""
    levels: tuple[Level, ...]
    models: frozenset[str] | None  # None: every model
    band: str
    wire: list = dataclasses.field(default_factory=list, compare=False)  # the levels as the accountant takes them
    personal_off: bool = False  # personal use, which is turned off: refused whatever else is set
    profile: str | None = None  # the nearest routing profile set (key, project, team, org, person); None: none
    split: dict = dataclasses.field(default_factory=dict, compare=False)  # `parts`' answers, by how many parts

    def parts(self, count: int) -> list[tuple[int, list]]:
        """The levels (as the accountant takes them) of each accountant part that counts any, of COUNT parts, in
        the order of the parts: every gateway admits a request held in two parts in the same order."""
        found = self.split.get(count)
        if found is None:
            by_part: dict[int, list] = {}
            for level, wire in zip(self.levels, self.wire):
                by_part.setdefault(part_of(level.home, count), []).append(wire)
            found = self.split[count] = sorted(by_part.items())
        return found


# The largest count a limit may be: rpm and tpm are INTEGER columns, 32 bits on PostgreSQL. A larger
# number once reached the store and answered 500 (OverflowError); clearing the limit means "no limit".
LARGEST_COUNT = 2**31 - 1
# The largest amount of money, in whole units, a budget or price may be: far past any real one, and in
# micro-units (10^15) it leaves the store's 64-bit columns room to sum many. `1e400` once answered 500.
LARGEST_AMOUNT = 10**9


def _echo(text) -> str:
    """TEXT as a message quotes it: short, since messages travel in the session cookie's flash."""
    text = str(text)
    return repr(text if len(text) <= 20 else text[:20] + "…")


def parse_count(name: str, text: str | int) -> int:
    """A limit's whole number as written by a person ("60"), from 0 to LARGEST_COUNT."""
    digits = str(text).strip()
    # Length first: int() of thousands of digits is refused by Python itself, and is slow before that.
    if not (digits.isascii() and digits.isdigit()) or len(digits.lstrip("0")) > len(str(LARGEST_COUNT)) \
            or int(digits) > LARGEST_COUNT:
        raise LimitError(f"{name} is a whole number from 0 to {LARGEST_COUNT:,}, not {_echo(text)}")
    return int(digits)


def parse_money(text: str | float | int, what: str = "") -> int:
    """Whole units as written by a person ("50", "0.25") in micro-units, from 0 to LARGEST_AMOUNT units;
    WHAT ("the budget") names the amount in the message."""
    try:
        value = Decimal(str(text).strip())
    except InvalidOperation:
        value = Decimal("NaN")
    # is_finite() first: comparing a NaN raises InvalidOperation.
    if not value.is_finite() or not 0 <= value <= LARGEST_AMOUNT:
        raise LimitError(f"{what} {_echo(text)} is not an amount; write a number of whole units from 0 to "
                         f"{LARGEST_AMOUNT:,}, such as 50 or 0.25".lstrip())
    return int(value * MICROS)


def show_money(micros: int | None) -> str:
    if micros is None:
        return "-"
    return f"{Decimal(micros) / MICROS:,.6f}".rstrip("0").rstrip(".")


def period_start(period: str, now: float) -> float:
    """The start of NOW's day or month, in UTC (whatever this machine's time zone, summer time included)."""
    t = time.gmtime(now)
    return float(calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday if period == "day" else 1, 0, 0, 0)))


@dataclasses.dataclass(frozen=True)
class Price:
    input: int = 0  # micro-units per million tokens
    output: int = 0

    def zero(self) -> bool:
        return not (self.input or self.output)

    def cost(self, prompt: int, completion: int) -> int:
        # Rounded up: a stream of tiny requests must not be free.
        return math.ceil((prompt * self.input + completion * self.output) / MICROS)


class Prices:
    def __init__(self, by_model: dict[str, Price]):
        self.by_model = by_model
        self.fallback = by_model.get("*", Price())

    def of(self, model: str) -> Price:
        return self.by_model.get(model, self.fallback)

    def anything_priced(self) -> bool:
        return any(not p.zero() for p in self.by_model.values())


def counter(scope: str, scope_id: str, user_id: str | None = None) -> str:
    return f"{scope}:{scope_id}/{user_id}" if scope.endswith("_member") else f"{scope}:{scope_id}"


class Rules:
    """The tree, the limits and the memberships read at one moment, to resolve principals from."""

    def __init__(self, limits: dict[tuple[str, str], Limits], parents: dict[str, tuple[str, str]],
                 team_org: dict[str, str]):
        self.limits = limits
        self.parents = parents  # project id -> (team id, org id)
        self.team_org = team_org


    def scopes_of(self, key_id: str | None, project_id: str | None, user_id: str | None) -> list[tuple[str, str, str]]:
        """(scope, id, counter) for every level that could apply, nearest first."""
        out = []
        if key_id:
            out.append(("key", key_id, counter("key", key_id)))
        if project_id and project_id in self.parents:
            team_id, org_id = self.parents[project_id]
            for scope, sid in (("project", project_id), ("team", team_id), ("org", org_id)):
                if user_id:
                    out.append((f"{scope}_member", sid, counter(f"{scope}_member", sid, user_id)))
                out.append((scope, sid, counter(scope, sid)))
        if user_id and not project_id:
            out.append(("personal", "", counter("personal", user_id)))
        if user_id:
            out.append(("user", user_id, counter("user", user_id)))
        return out

    def homes(self, key_id: str | None, project_id: str | None, user_id: str | None) -> tuple[str, str]:
        """The homes (`Level.home`) of a principal's pools: (its tree's and key's, its person's). A tree's pools
        live with its organisation, so the levels of a project's key are mostly counted by one part; a person's
        own pools (theirs, personal use, the cluster's default) span organisations and live with the person."""
        person = user_id or key_id or ""
        if project_id and project_id in self.parents:
            return self.parents[project_id][1], person
        return person, person

    @staticmethod
    def default_pool(scopes: list[tuple[str, str, str]]) -> str:
        """The counter the cluster's defaults are counted in for a principal of SCOPES (`scopes_of`): the
        person behind it when there is one (anyone may make keys for themselves, and three keys once tripled
        a default of 2 a minute), else its first (the key)."""
        own = next((c for scope, _sid, c in scopes if scope == "user"), scopes[0][2])
        return f"default:{own}"

    def tree_home(self, scope: str, scope_id: str) -> str:
        """The home (`Level.home`) of an organisation's, team's or project's own pool: its organisation."""
        if scope == "project":
            return self.parents.get(scope_id, ("", ""))[1]
        return self.team_org.get(scope_id, "") if scope == "team" else scope_id

    def access(self, key_id: str | None, project_id: str | None, user_id: str | None) -> Access:
        """The levels, allowlist and band for a key (KEY_ID) or a signed-in person (KEY_ID None)."""
        levels: list[Level] = []
        allowed: frozenset[str] | None = None
        band = None
        set_rpm = set_tpm = False
        scopes = self.scopes_of(key_id, project_id, user_id)
        tree, person = self.homes(key_id, project_id, user_id)
        found = [(scope, sid, c, self.limits.get((scope, sid))) for scope, sid, c in scopes]
        found.append(("cluster", "", "", self.limits.get(("cluster", ""))))  # its counter is never one of its own
        pool = self.default_pool(scopes) if scopes else "default:"
        personal_off = False
        # The nearest routing profile: the key's, its tree's, the person's own, then personal use's; never the
        # cluster's (that is each gateway's routing.default_profile, below a model's own).
        profile = next((lim.profile for scope, _sid, _c, lim in sorted(
            found, key=lambda f: f[0] == "personal") if lim is not None and lim.profile and scope != "cluster"), None)
        for scope, _sid, count, lim in found:
            if lim is None:
                continue
            personal_off |= scope == "personal" and bool(lim.disabled)
            if lim.models is not None:
                allowed = frozenset(lim.models) if allowed is None else allowed & frozenset(lim.models)
            if band is None and lim.band:
                band = lim.band
            if scope == "cluster":
                # Defaults: each applies only where no level set its own.
                rpm = None if set_rpm else lim.rpm
                tpm = None if set_tpm else lim.tpm
                budget = lim.budget if not any(lv.budget is not None for lv in levels) else None
                if rpm is not None or tpm is not None or budget is not None:
                    levels.append(Level(pool, rpm, tpm, budget, lim.period or "month", person))
                continue
            if lim.rpm is None and lim.tpm is None and lim.budget is None:
                continue
            set_rpm |= lim.rpm is not None
            set_tpm |= lim.tpm is not None
            levels.append(Level(count, lim.rpm, lim.tpm, lim.budget, lim.period or "month",
                                person if scope in PERSON_SCOPES else tree))
        return Access(tuple(levels), allowed, band or DEFAULT_BAND, [lv.wire() for lv in levels], personal_off,
                      profile)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One field of one scope as the quotas page shows it."""
    own: object  # set here, or None
    value: object  # what binds here: the strictest along the way up (numbers), or the nearest set (others)
    source: str  # where VALUE comes from ("" when set here)
    unreachable: bool  # set here, but a stricter level above caps it


def effective(rules: Rules, scope: str, scope_id: str, names: dict[str, str]) -> dict[str, Cell]:
    """Each field at SCOPE/SCOPE_ID: its own value, what binds and where that is set, looking up
    the tree and then at the cluster's defaults. NAMES gives a label for each "scope:id"."""
    chain = [(scope, scope_id)]
    team = rules.parents[scope_id][0] if scope == "project" and scope_id in rules.parents else \
        scope_id if scope == "team" else None
    if team:
        if scope == "project":
            chain.append(("team", team))
        if team in rules.team_org:
            chain.append(("org", rules.team_org[team]))
    chain.append(("cluster", ""))
    own = rules.limits.get((scope, scope_id), Limits())
    cells = {}
    for name in FIELDS:
        best, source = None, ""
        for s, sid in chain:
            value = getattr(rules.limits.get((s, sid), Limits()), name)
            if value is None:
                continue
            if s == "cluster" and best is not None:
                break  # defaults fill gaps only
            if best is None or (name in ("rpm", "tpm", "budget") and value < best):
                best, source = value, "" if (s, sid) == (scope, scope_id) else names.get(f"{s}:{sid}", s)
            if name not in ("rpm", "tpm", "budget"):
                break
        mine = getattr(own, name)
        cells[name] = Cell(mine, best, source, mine is not None and best is not None and source != "")
    return cells
