import collections
import random

from llmgw.gateway.balancer import ReplicaState, Router, affinity_key, choose
from llmgw.gateway.breaker import MAX_COOLDOWN, Breaker
from llmgw.gateway.snapshot import ModelSpec, ReplicaSpec, Snapshot

STALE = 5.0


def pick(rs, rng, key=None, follows=False, policy="prefix"):
    return choose(policy, rs, 0.0, STALE, key, follows, 1.25, rng)


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
    assert all(pick([a, b], rng) is b for _ in range(100))


def test_load_is_spread_not_piled_on_one_replica():
    rs = replicas(4)
    rng = random.Random(7)
    for _ in range(400):
        pick(rs, rng).outstanding += 1
    counts = [r.outstanding for r in rs]
    # With every request still outstanding, two choices keeps the replicas within a few of each other.
    assert max(counts) - min(counts) <= 4, counts


def test_weights_share_traffic():
    rs = replicas(2, weights=[3.0, 1.0])
    rng = random.Random(3)
    for _ in range(400):
        pick(rs, rng).outstanding += 1
    # Load per unit of weight is balanced: about 300 and 100.
    assert 280 <= rs[0].outstanding <= 320, [r.outstanding for r in rs]


def conversation(n):
    return affinity_key([b"You are a helpful assistant." * 10, f"question {n}".encode()])


def test_a_conversation_sticks_to_one_replica_and_conversations_spread():
    rs = replicas(4)
    rng = random.Random(5)
    assert len({pick(rs, rng, conversation(1), follows=True).spec.id for _ in range(50)}) == 1
    spread = collections.Counter(pick(rs, rng, conversation(i), follows=True).spec.id for i in range(200))
    assert len(spread) == 4 and min(spread.values()) >= 25, spread


def test_conversations_go_first_to_replicas_in_proportion_to_their_weight():
    rs = replicas(2, weights=[3.0, 1.0])
    rng = random.Random(2)
    # Every replica idle, so each conversation's first choice takes it, whatever its load per weight.
    first = collections.Counter(choose("prefix", rs, 0.0, STALE, conversation(i), True, 100.0, rng).spec.id
                                for i in range(2000))
    assert 1400 <= first["r0"] <= 1600, first


def test_a_conversation_stays_until_its_replica_is_loaded_past_the_bound_then_spills_to_its_second_choice():
    rs = replicas(4)
    rng = random.Random(5)
    key = conversation(7)
    first = pick(rs, rng, key, follows=True)
    for r in rs:
        r.outstanding = 0 if r is first else 3
    # The others' load is 4 (three and the new one): the first choice takes turns while its load is at most
    # max(1.25 x 4, 4 + 1) = 5, that is, with up to four of them outstanding.
    went = []
    for _ in range(8):
        chosen = pick(rs, rng, key, follows=True)
        chosen.outstanding += 1
        went.append(chosen)
    assert went[:5] == [first] * 5
    # Then its next choice, the same one each time while it too is within the bound, not whichever is least loaded.
    assert went[5] is not first and went[6] is went[5]
    # When the first choice is back within the bound, the conversation is back there.
    first.outstanding = 1
    assert pick(rs, rng, key, follows=True) is first


def test_a_first_turn_goes_to_the_least_loaded():
    rs = replicas(4)
    rng = random.Random(5)
    key = conversation(3)
    first = pick(rs, rng, key, follows=True)
    assert pick(rs, rng, key) is first  # all idle: its own first choice, so the next turn finds it there
    first.outstanding = 1
    # One request ahead is within the bound for a later turn, but a first turn has nothing cached to win.
    assert pick(rs, rng, key, follows=True) is first
    chosen = pick(rs, rng, key)
    assert chosen is not first and chosen.outstanding == 0


def test_the_bound_keeps_the_replicas_balanced():
    rs = replicas(4)
    rng = random.Random(9)
    # 400 turns of 40 conversations, none finished: the bound holds every replica near the least loaded.
    for i in range(400):
        pick(rs, rng, conversation(i % 40), follows=True).outstanding += 1
    counts = [r.outstanding for r in rs]
    assert max(counts) <= 1.25 * min(counts) + 1, counts


def test_without_a_key_the_prefix_policy_goes_by_load():
    a, b = replicas(2)
    a.outstanding = 5
    rng = random.Random(1)
    assert all(pick([a, b], rng, None, follows=True) is b for _ in range(20))
    assert affinity_key([b"", b""]) is None and affinity_key([]) is None


def test_round_robin_takes_each_in_turn_by_weight_whatever_the_load():
    rs = replicas(3)
    rng = random.Random(1)
    rs[0].outstanding = 50
    assert [pick(rs, rng, policy="round-robin").spec.id for _ in range(6)] == ["r0", "r1", "r2"] * 2
    weighted = replicas(2, weights=[3.0, 1.0])
    served = collections.Counter(pick(weighted, rng, policy="round-robin").spec.id for _ in range(400))
    assert served == {"r0": 300, "r1": 100}
    # Least-load ignores a conversation's key.
    a, b = replicas(2)
    a.outstanding = 5
    assert all(pick([a, b], rng, conversation(1), True, policy="least-load") is b for _ in range(20))


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


def test_only_a_replica_found_hung_has_its_waiting_requests_moved():
    from llmgw.gateway.upstream import Cancel

    class Conn:  # what a Cancel closes: the connection its request waits on
        closed = False

        class sock:
            @staticmethod
            def shutdown(how):
                pass

        def close(self):
            self.closed = True

    spec = lambda rid: ReplicaSpec(rid, f"http://{rid}", ("m",))  # noqa: E731
    router = Router(Snapshot(1, {"m": ModelSpec("m")}, {r: spec(r) for r in "abc"}), 2, 10.0, STALE, 1.25, seed=1)
    waiting = {}
    for rid in "abc":
        cancel = Cancel()
        cancel.conn = Conn()
        router.states[rid].unanswered.add(cancel)
        waiting[rid] = cancel
    # b is stopped or drained (it finishes what it has); c's node found its engine hung.
    router.apply(Snapshot(2, {"m": ModelSpec("m")}, {"a": spec("a")}, unhealthy=frozenset({"c"})))
    assert [rid for rid, cancel in waiting.items() if cancel.abandoned] == ["c"]
    assert not waiting["c"].cancelled  # the client is still there: the request goes to another replica
    # A breaker that opens does the same (its health checks failed: hung as far as this worker can tell).
    cancel = Cancel()
    cancel.conn = Conn()
    router.states["a"].unanswered.add(cancel)
    router.states["a"].leave()
    assert cancel.abandoned


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


def test_a_worker_reads_the_engines_of_the_models_it_routed_to_lately():
    snap = Snapshot(1, {"m": ModelSpec("m"), "n": ModelSpec("n")},
                    {"a": ReplicaSpec("a", "http://a", ("m",)), "b": ReplicaSpec("b", "http://b", ("n",))})
    router = Router(snap, 2, 10.0, STALE, 1.25, seed=1)
    assert router.watched(0.0, 60.0) == ([], [])  # nothing routed: no engine is read
    router.pick("m", 100.0, None, set())
    assert router.watched(150.0, 60.0) == ([router.states["a"]], ["m"])
    router.has_room("n", 150.0)  # weighing a request's admission counts as routing it
    states, models = router.watched(161.0, 60.0)
    assert states == [router.states["b"]] and models == ["n"]  # m's last request is past the window
    assert "m" not in router.routed
    # A replica whose breaker opened stays read (its probe is due there) after its model goes quiet.
    router.states["b"].breaker.failure(0.0)
    router.states["b"].breaker.failure(0.0)
    assert router.watched(1000.0, 60.0) == ([router.states["b"]], [])
    # A model gone from the snapshot is forgotten.
    router.pick("n", 1000.0, None, set())
    router.apply(Snapshot(2, {"m": ModelSpec("m")}, {"a": ReplicaSpec("a", "http://a", ("m",))}))
    assert router.watched(1001.0, 60.0) == ([], []) and router.routed == {}


def test_the_cluster_page_shows_an_engines_figures_only_while_they_are_fresh():
    # A worker reads the engines of the models it routes to; a replica of a model it stopped routing to keeps
    # the last figures it read, which the page must not show as current.
    import time
    from types import SimpleNamespace

    from llmgw.web.adminpages import _cluster_view

    router = Router(Snapshot(1, {"m": ModelSpec("m")}, {r: ReplicaSpec(r, f"http://{r}", ("m",)) for r in "ab"}),
                    2, 10.0, STALE, 1.25, seed=1)
    now = time.monotonic()
    router.states["a"].record_metrics({"waiting": 3.0, "kv_cache": 0.5}, now)
    router.states["b"].record_metrics({"waiting": 7.0, "kv_cache": 0.9}, now - 3600)
    view = _cluster_view(SimpleNamespace(router=router), {"gateway.controller": None,
                                                           "routing.metrics_stale_after": STALE})
    shown = {r["id"]: (r["waiting"], r["kv"]) for r in view["gateway_replicas"]}
    assert shown == {"a": (3.0, 0.5), "b": (None, None)}
