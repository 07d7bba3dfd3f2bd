"""Choosing a replica for a request: least loaded of two, or the one with the prompt cached.

Round-robin leaves one replica with seven requests while another sits idle,
because answers take wildly different times. Here a replica's load is what
this worker has outstanding on it now, plus what the engine last reported
waiting and running beyond this worker's own requests at that moment (other
workers' and other gateways' traffic). Counting our own requests from the
engine's figures as well made a replica look busy for a second after its
answer was done. Figures older than `stale_after` are ignored: routing on an
old queue length is worse than routing on what we know. Two replicas are
drawn by weight and the less loaded (per unit of weight) wins: the power of
two choices keeps queues short without every worker piling onto the same
"least loaded" replica between two metric reads.

Prompt affinity: requests that share the start of their prompt are sent to the
same replica (chosen by rendezvous hashing, so every worker picks the same one
with no shared state), where the engine's prefix cache already holds it, as
long as that replica is no busier than `affinity_factor` times the least
loaded one, or at most one request busier.

A replica whose profile was measured (`llmgw ctl bench --save`) carries the
requests in flight it takes at once (`ReplicaState.limit`); a full one is
passed over while another has room, and when all are full the admission
queue holds the request (llmgw/gateway/admission.py). That limit is kept
here, in the replica's state, and nowhere else.
"""

from __future__ import annotations

import hashlib
import random

from llmgw.gateway.breaker import Breaker
from llmgw.gateway.snapshot import ReplicaSpec, Snapshot


class ReplicaState:
    """What one worker knows about one replica."""

    __slots__ = ("spec", "target", "outstanding", "breaker", "waiting", "running", "kv_cache", "metrics_at",
                 "outstanding_at_metrics", "seed", "checked_at")

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
        self.seed = hashlib.blake2b(spec.id.encode(), digest_size=8).digest()
        self.checked_at: float | None = None  # the last health check an engine error prompted

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


def affinity_key(text: bytes, prefix_bytes: int) -> bytes | None:
    if prefix_bytes <= 0 or not text:
        return None
    return hashlib.blake2b(text[:prefix_bytes], digest_size=8).digest()


def _rendezvous(key: bytes, replica: ReplicaState) -> bytes:
    return hashlib.blake2b(key, key=replica.seed, digest_size=8).digest()


def choose(candidates: list[ReplicaState], now: float, stale_after: float, key: bytes | None,
           affinity_factor: float, rng: random.Random) -> ReplicaState:
    """One of CANDIDATES (not empty, breakers already checked) for a request."""
    if len(candidates) == 1:
        return candidates[0]
    loads = {id(r): r.load(now, stale_after) / r.spec.weight for r in candidates}
    if key is not None:
        preferred = max(candidates, key=lambda r: _rendezvous(key, r))
        least = min(loads.values())
        # At low load a ratio alone is too strict: 2 against 1 is "twice as busy", yet one request
        # ahead costs less than recomputing a long prompt. So one request more than the least
        # loaded is always acceptable, and beyond that the factor decides.
        if loads[id(preferred)] <= max(affinity_factor * least, least + 1.0):
            return preferred
    weights = [r.spec.weight for r in candidates]
    a, b = rng.choices(candidates, weights=weights, k=2)
    if a is b:
        b = rng.choice([r for r in candidates if r is not a])
    return a if loads[id(a)] <= loads[id(b)] else b


class Router:
    """A worker's replicas: the current snapshot plus what it has learnt about each replica."""

    def __init__(self, snapshot: Snapshot, breaker_failures: int, breaker_cooldown: float, stale_after: float,
                 affinity_factor: float, make_target=None, seed: int | None = None, max_outstanding: int = 0):
        self.make_target = make_target or (lambda url, api_key: None)
        self.max_outstanding = max_outstanding  # a replica's requests from this worker at once, unmeasured (0: any)
        self.breaker_failures = breaker_failures
        self.breaker_cooldown = breaker_cooldown
        self.stale_after = stale_after
        self.affinity_factor = affinity_factor
        self.rng = random.Random(seed)
        self.snapshot = snapshot
        self.states: dict[str, ReplicaState] = {}
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
        self.states = states
        self.measured = frozenset(m for spec in snapshot.replicas.values() if spec.max_in_flight is not None
                                  for m in spec.models)
        self.snapshot = snapshot

    def available(self, model: str) -> list[ReplicaState]:
        states = self.states
        return [states[rid] for rid in self.snapshot.replicas_for(model) if not states[rid].breaker.is_open]

    def pick(self, model: str, now: float, key: bytes | None, exclude: set[str]) -> ReplicaState | None:
        """A replica for a request, among those with room when any has (a full one only when none has: the
        admission queue let the request through, and the engine's own queue takes it)."""
        candidates = [r for r in self.available(model) if r.spec.id not in exclude]
        if not candidates:
            return None
        roomy = [r for r in candidates if not r.full(now, self.stale_after, self.max_outstanding)]
        return choose(roomy or candidates, now, self.stale_after, key, self.affinity_factor, self.rng)

    def limited(self, model: str) -> bool:
        """Whether anything limits the requests MODEL's replicas are sent at once (else none ever waits for room)."""
        return bool(self.max_outstanding) or model in self.measured

    def has_room(self, model: str, now: float) -> bool:
        """Whether some replica of MODEL in rotation can take one more request now."""
        return any(not r.full(now, self.stale_after, self.max_outstanding) for r in self.available(model))

    def replica_for(self, model: str, replica_id: str) -> ReplicaState | None:
        """Replica REPLICA_ID, when it serves MODEL (in rotation or not); None otherwise."""
        state = self.states.get(replica_id)
        return state if state is not None and model in state.spec.models else None

    def ready(self) -> bool:
        """Somewhere to send a request: at least one replica whose breaker is closed."""
        return any(not s.breaker.is_open for s in self.states.values())
