"""Choosing a replica for a request: by its conversation's prefix (the default), by load, or in turn.

`routing.policy` picks one of three, all per worker and with no shared state:

- `least-load`: two replicas drawn by weight, the less loaded (per unit of
  weight) wins. Round-robin leaves one replica with seven requests while
  another sits idle, because answers take wildly different times; "always the
  least loaded" makes every worker stampede the same replica between two
  metric reads; the power of two choices keeps queues short without either.
- `prefix`: a request that continues a conversation goes where its history is
  cached. The replicas are ranked for the conversation's key by weighted
  rendezvous hashing (every worker of every gateway ranks them alike, removing
  one moves only its own conversations, and each comes first for a share of
  the conversations in proportion to its weight), and the first one loaded no more than
  `affinity_factor` times the least loaded one, or one request more, takes
  it. Past that bound the next in the ranking is tried, so a conversation
  spilled off a busy replica keeps landing on the same second one and finds
  its history there too. A conversation's first request (nothing after its
  first user message) has nothing cached on one replica that the others
  lack, so it goes to the first in its ranking among the least loaded: no
  request waits for affinity that cannot pay it back. A request without a key (an
  embedding, a prompt that is not text) is routed by load.
- `round-robin`: each replica in turn, in proportion to its weight (smooth
  weighted round-robin). Offered for comparison and for engines whose load
  cannot be read; it ignores load.

A replica's load is what this worker has outstanding on it now, plus what the
engine last reported waiting and running beyond this worker's own requests at
that moment (other workers' and other gateways' traffic). Counting our own
requests from the engine's figures as well made a replica look busy for a
second after its answer was done. Figures older than `stale_after` are
ignored: routing on an old queue length is worse than routing on what we know.

A replica whose profile was measured (`llmgw ctl bench --save`) carries the
requests in flight it takes at once (`ReplicaState.limit`); a full one is
passed over while another has room, whatever the policy, and when all are full
the admission queue holds the request (llmgw/gateway/admission.py). That limit
is kept here, in the replica's state, and nowhere else.
"""

from __future__ import annotations

import hashlib
import math
import random
import zlib

from llmgw.gateway.breaker import Breaker
from llmgw.gateway.snapshot import ReplicaSpec, Snapshot

MASK64 = (1 << 64) - 1


class ReplicaState:
    """What one worker knows about one replica."""

    __slots__ = ("spec", "target", "outstanding", "breaker", "waiting", "running", "kv_cache", "metrics_at",
                 "outstanding_at_metrics", "seed", "checked_at", "turn", "unanswered")

    def __init__(self, spec: ReplicaSpec, breaker: Breaker, target=None):
        self.spec = spec
        self.target = target  # how to reach it (an upstream.Target), made once per replica
        self.outstanding = 0
        self.breaker = breaker
        self.waiting: float | None = None  # None: the engine has not told us
        self.running: float | None = None
        self.kv_cache: float | None = None
        self.metrics_at: float | None = None
        self.outstanding_at_metrics = 0  # ours among the engine's figures when it reported them
        self.seed = int.from_bytes(hashlib.blake2b(spec.id.encode(), digest_size=8).digest(), "big")
        self.checked_at: float | None = None  # the last health check an engine error prompted
        self.turn = 0.0  # round-robin's running credit
        # This worker's requests sent here and not yet answered (their upstream.Cancel): abandoned, and sent
        # elsewhere, when the replica is found hung (`leave`).
        self.unanswered: set = set()

    def leave(self) -> None:
        """The replica was found hung (its node says so, or its breaker opened): end each request still waiting
        for its answer here, so that it goes to another replica rather than waiting out timeouts.first_byte on an
        engine known not to answer. A replica that merely leaves the snapshot (stopped, drained, replaced)
        finishes what it has."""
        for cancel in list(self.unanswered):
            cancel.abandon()

    def fresh(self, now: float, stale_after: float) -> bool:
        return self.metrics_at is not None and now - self.metrics_at <= stale_after

    @property
    def limit(self) -> int | None:
        """Requests this replica takes at once, every worker's and gateway's together, as its profile was
        measured (`llmgw ctl bench --save`, sent in the snapshot); None: not measured."""
        return self.spec.max_in_flight

    def in_flight(self, now: float, stale_after: float) -> float:
        """Requests at the engine now, as far as this worker knows: its own, plus what the engine last
        reported waiting and running beyond them (other workers' and gateways')."""
        held = float(self.outstanding)
        if self.fresh(now, stale_after):
            reported = (self.waiting or 0.0) + (self.running or 0.0)
            held += max(0.0, reported - self.outstanding_at_metrics)
        return held

    def held(self, now: float, stale_after: float, per_worker: int) -> tuple[float, int]:
        """(requests held, the most this replica should hold): everyone's requests against its measured
        limit, or, not measured, this worker's own against PER_WORKER (`routing.max_outstanding`, 0: none).
        What `full` judges, and what a pool's saturation is made of (llmgw/gateway/saturation.py)."""
        if self.limit is not None:
            return self.in_flight(now, stale_after), self.limit
        return float(self.outstanding), per_worker

    def full(self, now: float, stale_after: float, per_worker: int) -> bool:
        """Whether a new request must wait for this replica: at its measured limit (everyone's requests
        counted), or, not measured, at PER_WORKER of this worker's own (`routing.max_outstanding`, 0: none)."""
        held, most = self.held(now, stale_after, per_worker)
        return bool(most) and held >= most

    def load(self, now: float, stale_after: float) -> float:
        """Requests ahead of a new one, counting the new one (so the idle load is 1)."""
        load = self.in_flight(now, stale_after)
        if self.fresh(now, stale_after):
            # A nearly full KV cache means the next request will queue even if
            # few are running: past half full, count it as up to one more request
            # ahead. Below that it is left out, so that small fractions do not tip
            # decisions between whole requests.
            load += max(0.0, (self.kv_cache or 0.0) - 0.5) * 2
        return load + 1.0

    def check_due(self, now: float, every: float) -> bool:
        """Whether an engine error should prompt a health check now (one every EVERY seconds at most)."""
        if self.checked_at is not None and now - self.checked_at < every:
            return False
        self.checked_at = now
        return True

    def record_metrics(self, figures: dict[str, float], now: float) -> None:
        """Take the engine's own load figures (absent ones stay unknown)."""
        self.waiting = figures.get("waiting")
        self.running = figures.get("running")
        self.kv_cache = figures.get("kv_cache")
        self.metrics_at = now
        self.outstanding_at_metrics = self.outstanding


def affinity_key(pieces: list[bytes]) -> int | None:
    """The key that ranks replicas for a request whose cache-deciding start is PIECES; None when they are empty.

    A CRC, not a cryptographic hash: two conversations that collide only share
    a replica, and any client can steer its own requests by their text whatever
    the hash. With blake2b here and in the ranking, bench/routing.py measured
    the prefix policy's check and choice of a 44 KB chat at 35 to 47 µs more
    than least-load's; with CRC-32 and an integer mix, about 10 µs more.
    """
    key = 0
    for piece in pieces:
        # Each piece's length first, so that ("ab", "c") and ("a", "bc") differ.
        key = zlib.crc32(piece, zlib.crc32(len(piece).to_bytes(4, "big"), key))
    return key if any(pieces) else None


def _rendezvous(key: int, replica: ReplicaState) -> float:
    """REPLICA's score for KEY, the highest first.

    Both are mixed by splitmix64's finaliser, which spreads any change of either
    over every bit, so each key ranks the replicas in an order of its own; the
    result, read as a number u in (0, 1), scores -weight / ln(u), which puts a
    replica first for a share of the keys in proportion to its weight.
    """
    x = (key * 0x9E3779B97F4A7C15 ^ replica.seed) & MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    x ^= x >> 31
    return -replica.spec.weight / math.log((x + 1) / (MASK64 + 2))


def choose(policy: str, candidates: list[ReplicaState], now: float, stale_after: float, key: int | None,
           follows: bool, affinity_factor: float, rng: random.Random) -> ReplicaState:
    """One of CANDIDATES (not empty, breakers already checked) for a request under POLICY.

    KEY ranks the replicas for the request's conversation; FOLLOWS says the
    request continues it, so its history may be cached on the first ranked.
    """
    if len(candidates) == 1:
        return candidates[0]
    if policy == "round-robin":
        return _in_turn(candidates)
    loads = {id(r): r.load(now, stale_after) / r.spec.weight for r in candidates}
    if policy == "prefix" and key is not None:
        least = min(loads.values())
        # At low load a ratio alone is too strict: 2 against 1 is "twice as busy", yet one request
        # ahead costs less than recomputing a long history. So one request more than the least
        # loaded is always acceptable, and beyond that the factor decides.
        bound = max(affinity_factor * least, least + 1.0) if follows else least
        ranked = sorted(candidates, key=lambda r: _rendezvous(key, r), reverse=True)
        return next(r for r in ranked if loads[id(r)] <= bound)
    weights = [r.spec.weight for r in candidates]
    a, b = rng.choices(candidates, weights=weights, k=2)
    if a is b:
        b = rng.choice([r for r in candidates if r is not a])
    return a if loads[id(a)] <= loads[id(b)] else b


def _in_turn(candidates: list[ReplicaState]) -> ReplicaState:
    """Smooth weighted round-robin: each gains its weight, the richest is chosen and pays the total."""
    total = 0.0
    for r in candidates:
        r.turn += r.spec.weight
        total += r.spec.weight
    chosen = max(candidates, key=lambda r: r.turn)
    chosen.turn -= total
    return chosen


class Router:
    """A worker's replicas: the current snapshot plus what it has learnt about each replica."""

    def __init__(self, snapshot: Snapshot, breaker_failures: int, breaker_cooldown: float, stale_after: float,
                 affinity_factor: float, make_target=None, seed: int | None = None, max_outstanding: int = 0,
                 policy: str = "prefix"):
        self.make_target = make_target or (lambda url, api_key: None)
        self.max_outstanding = max_outstanding  # a replica's requests from this worker at once, unmeasured (0: any)
        self.policy = policy
        self.breaker_failures = breaker_failures
        self.breaker_cooldown = breaker_cooldown
        self.stale_after = stale_after
        self.affinity_factor = affinity_factor
        self.rng = random.Random(seed)
        self.snapshot = snapshot
        self.states: dict[str, ReplicaState] = {}
        # When this worker last routed (or weighed admitting) a request of each model: what it reads engines for.
        self.routed: dict[str, float] = {}
        self.measured: frozenset[str] = frozenset()  # models with a replica whose capacity was measured
        self.apply(snapshot)

    def apply(self, snapshot: Snapshot) -> None:
        """Adopt SNAPSHOT, keeping load and breaker state of replicas that persist."""
        states = {}
        for rid, spec in snapshot.replicas.items():
            state = self.states.get(rid)
            if state is None or (state.spec.url, state.spec.api_key) != (spec.url, spec.api_key):
                state = ReplicaState(spec, Breaker(self.breaker_failures, self.breaker_cooldown),
                                     self.make_target(spec.url, spec.api_key))
            else:
                state.spec = spec
            states[rid] = state
        for rid in snapshot.unhealthy:
            state = self.states.get(rid)
            if state is not None:
                state.leave()
        self.states = states
        self.measured = frozenset(m for spec in snapshot.replicas.values() if spec.max_in_flight is not None
                                  for m in spec.models)
        self.snapshot = snapshot

    def available(self, model: str) -> list[ReplicaState]:
        states = self.states
        return [states[rid] for rid in self.snapshot.replicas_for(model) if not states[rid].breaker.is_open]

    def serves(self, model: str) -> bool:
        """Whether any replica of MODEL is in rotation: `available` asked only for yes or no, stopping at the
        first (`/v1/models` asks it of every model, and listed every replica of each to answer)."""
        states = self.states
        return any(not states[rid].breaker.is_open for rid in self.snapshot.replicas_for(model))

    def pick(self, model: str, now: float, key: int | None, exclude: set[str], follows: bool = False,
             profile=None) -> ReplicaState | None:
        """A replica of MODEL outside EXCLUDE for a request (see `choose`), among those with room when any has
        (a full one only when none has: the admission queue let the request through, and the engine's own queue
        takes it); None when there is none. PROFILE (a RoutingProfile) chooses the policy and affinity factor
        in place of the router's own."""
        self.routed[model] = now
        candidates = [r for r in self.available(model) if r.spec.id not in exclude]
        if not candidates:
            return None
        roomy = [r for r in candidates if not r.full(now, self.stale_after, self.max_outstanding)]
        policy, factor = (self.policy, self.affinity_factor) if profile is None else (profile.policy,
                                                                                       profile.affinity_factor)
        return choose(policy, roomy or candidates, now, self.stale_after, key, follows, factor, self.rng)

    def limited(self, model: str) -> bool:
        """Whether anything limits the requests MODEL's replicas are sent at once (else none ever waits for room)."""
        return bool(self.max_outstanding) or model in self.measured

    def has_room(self, model: str, now: float) -> bool:
        """Whether some replica of MODEL in rotation can take one more request now."""
        self.routed[model] = now
        return any(not r.full(now, self.stale_after, self.max_outstanding) for r in self.available(model))

    def replica_for(self, model: str, replica_id: str) -> ReplicaState | None:
        """Replica REPLICA_ID, when it serves MODEL (in rotation or not); None otherwise."""
        state = self.states.get(replica_id)
        return state if state is not None and model in state.spec.models else None

    def watched(self, now: float, window: float) -> tuple[list[ReplicaState], list[str]]:
        """The replicas whose engines this worker reads, and their models: every replica of a model it routed to
        within WINDOW seconds, and any whose breaker is open (its probe is due there). A worker routes on the
        figures of the models it serves; reading every replica's, every worker did a replica count of reads a
        second whatever it served (docs/scaling.md, the control plane's ceiling 4)."""
        routed = self.routed
        replicas_for = self.snapshot.replicas_for
        models = [m for m, at in routed.items() if now - at <= window and replicas_for(m)]
        if len(models) < len(routed):
            self.routed = {m: routed[m] for m in models}  # forget models gone idle or gone
        states = self.states
        chosen = {rid: states[rid] for m in models for rid in replicas_for(m)}
        for rid, state in states.items():
            if state.breaker.is_open:
                chosen[rid] = state
        return list(chosen.values()), models

    def ready(self) -> bool:
        """Somewhere to send a request: at least one replica whose breaker is closed."""
        return any(not s.breaker.is_open for s in self.states.values())
