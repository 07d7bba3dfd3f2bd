import collections
import random

from llmgw.gateway.balancer import ReplicaState, Router, affinity_key, choose
from llmgw.gateway.breaker import MAX_COOLDOWN, Breaker
from llmgw.gateway.snapshot import ModelSpec, ReplicaSpec, Snapshot

STALE = 5.0


def replicas(n, weights=None):
    return [ReplicaState(ReplicaSpec(f"r{i}", f"http://h{i}", ("m",), (weights or [1.0] * n)[i]), Breaker(5, 10))
            for i in range(n)]


def test_idle_load_counts_the_new_request():
    r = replicas(1)[0]
    assert r.load(0.0, STALE) == 1.0
    r.outstanding = 3
    assert r.load(0.0, STALE) == 4.0


def test_fresh_engine_figures_count_other_workers_requests():
    r = replicas(1)[0]
    r.outstanding = 1
    r.record_metrics({"waiting": 4.0, "running": 2.0, "kv_cache": 0.75}, 100.0)
    # The engine saw 6, one of them ours: 1 ours + 5 others + 0.5 for a cache three quarters full + 1 for the new one.
    assert r.load(101.0, STALE) == 7.5
    r.record_metrics({"running": 1.0, "kv_cache": 0.3}, 102.0)
    assert r.load(102.0, STALE) == 2.0  # a cache under half full adds nothing
    # Figures older than stale_after are ignored: only what this worker sent counts.
    assert r.load(106.0, STALE) == 2.0


def test_our_own_finished_requests_do_not_linger_in_the_engines_figures():
    r = replicas(1)[0]
    r.outstanding = 1
    r.record_metrics({"running": 1.0}, 100.0)  # the one running was ours
    r.outstanding = 0  # and it has finished since
    assert r.load(100.5, STALE) == 1.0


def test_two_choices_never_picks_the_busier_of_two():
    a, b = replicas(2)
    a.outstanding = 5
    rng = random.Random(1)
    assert all(choose([a, b], 0.0, STALE, None, 1.25, rng) is b for _ in range(100))


def test_load_is_spread_not_piled_on_one_replica():
    rs = replicas(4)
    rng = random.Random(7)
    for _ in range(400):
        choose(rs, 0.0, STALE, None, 1.25, rng).outstanding += 1
    counts = [r.outstanding for r in rs]
    # With every request still outstanding, two choices keeps the replicas within a few of each other.
    assert max(counts) - min(counts) <= 4, counts


def test_weights_share_traffic():
    rs = replicas(2, weights=[3.0, 1.0])
    rng = random.Random(3)
    for _ in range(400):
        choose(rs, 0.0, STALE, None, 1.25, rng).outstanding += 1
    # Load per unit of weight is balanced: about 300 and 100.
    assert 280 <= rs[0].outstanding <= 320, [r.outstanding for r in rs]


def test_affinity_sends_a_shared_prefix_to_one_replica():
    rs = replicas(4)
    rng = random.Random(5)
    key = affinity_key(b"You are a helpful assistant." * 10, 2048)
    picks = {choose(rs, 0.0, STALE, key, 1.25, rng).spec.id for _ in range(50)}
    assert len(picks) == 1
    other = affinity_key(b"A different system prompt entirely." * 10, 2048)
    spread = collections.Counter(
        choose(rs, 0.0, STALE, affinity_key(f"prompt {i}".encode(), 2048), 1.25, rng).spec.id for i in range(200))
    assert len(spread) == 4 and other != key


def test_affinity_yields_to_load_beyond_the_factor():
    rs = replicas(2)
    rng = random.Random(5)
    key = affinity_key(b"shared prefix", 2048)
    preferred = choose(rs, 0.0, STALE, key, 1.25, rng)
    other = rs[1] if preferred is rs[0] else rs[0]
    # Load 2 (one outstanding + the new) against 1: one request more is always acceptable.
    preferred.outstanding = 1
    assert choose(rs, 0.0, STALE, key, 1.25, rng) is preferred
    # Load 3 against 1: past both 1.25 x 1 and 1 + 1, so the other replica takes it.
    preferred.outstanding = 2
    assert choose(rs, 0.0, STALE, key, 1.25, rng) is other
    # Load 11 against 8: 11 > 1.25 x 8 = 10, past the factor.
    preferred.outstanding, other.outstanding = 10, 7
    assert choose(rs, 0.0, STALE, key, 1.25, rng) is other
    # Load 5 against 4: 5 <= 1.25 x 4, so the cache wins.
    preferred.outstanding, other.outstanding = 4, 3
    assert choose(rs, 0.0, STALE, key, 1.25, rng) is preferred


def test_affinity_off_when_prefix_bytes_is_zero():
    assert affinity_key(b"anything", 0) is None
    assert affinity_key(b"", 2048) is None


def test_router_keeps_state_across_snapshots_and_skips_open_breakers():
    spec = lambda rid, url: ReplicaSpec(rid, url, ("m",))  # noqa: E731
    snap1 = Snapshot(1, {"m": ModelSpec("m")}, {"a": spec("a", "http://a"), "b": spec("b", "http://b")})
    router = Router(snap1, 2, 10.0, STALE, 1.25, seed=1)
    state_a = router.states["a"]
    state_a.outstanding = 2
    router.states["b"].breaker.failure(0.0)
    router.states["b"].breaker.failure(0.0)
    assert [r.spec.id for r in router.available("m")] == ["a"]
    assert router.pick("m", 0.0, None, set()).spec.id == "a"
    assert router.pick("m", 0.0, None, {"a"}) is None
    snap2 = Snapshot(2, {"m": ModelSpec("m")}, {"a": spec("a", "http://a"), "c": spec("c", "http://c")})
    router.apply(snap2)
    assert router.states["a"] is state_a and "b" not in router.states
    snap3 = Snapshot(3, {"m": ModelSpec("m")}, {"a": spec("a", "http://moved")})
    router.apply(snap3)
    assert router.states["a"] is not state_a  # a new address is a new replica


def test_snapshot_names_and_aliases():
    snap = Snapshot(1, {"m": ModelSpec("m", aliases=("fast", "n")), "n": ModelSpec("n")},
                    {"r": ReplicaSpec("r", "http://r", ("m", "n"))})
    assert snap.resolve("fast").name == "m"
    assert snap.resolve("n").name == "n"  # a model's own name beats another's alias
    assert snap.resolve("zzz") is None
    assert [name for name, _ in snap.listed_ids()] == ["m", "fast", "n"]
    assert snap.replicas_for("n") == ("r",)


def test_breaker_opens_probes_and_backs_off():
    b = Breaker(3, 10.0)
    assert not b.failure(0.0) and not b.failure(1.0)
    assert b.failure(2.0) and b.is_open
    assert not b.probe_due(11.0) and b.probe_due(12.0)
    b.probe_failed(12.0)
    assert b.cooldown == 20.0 and not b.probe_due(31.0) and b.probe_due(32.0)
    for _ in range(20):
        b.probe_failed(0.0)
    assert b.cooldown == MAX_COOLDOWN
    b.success()
    assert not b.is_open and b.cooldown == 10.0 and b.failures == 0


def test_a_success_resets_the_count_of_failures():
    b = Breaker(3, 1.0)
    b.failure(0.0)
    b.failure(0.0)
    b.success()
    b.failure(0.0)
    b.failure(0.0)
    assert not b.is_open
