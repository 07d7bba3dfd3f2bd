"""Pool saturation: the worse of a pool's queue and its engines' KV caches, 1.0 at the healthy limit."""

from llmgw.gateway.balancer import ReplicaState
from llmgw.gateway.breaker import Breaker
from llmgw.gateway.saturation import pool_saturation
from llmgw.gateway.snapshot import ReplicaSpec


def test_the_queue_counts_requests_in_flight_and_waiting_over_the_replicas_limits():
    # Two replicas that should hold 4 each: 6 in flight is three quarters; 2 more waiting is the limit.
    assert pool_saturation([(3, 4, None), (3, 4, None)], queued=0) == 0.75
    assert pool_saturation([(4, 4, None), (4, 4, None)], queued=2) == 1.25
    # A replica without a limit adds nothing to the queue's figure, either way.
    assert pool_saturation([(3, 4, None), (9, 0, None)], queued=1) == 1.0


def test_the_kv_caches_count_as_their_mean_and_the_worse_figure_wins():
    assert pool_saturation([(0, 0, 0.5), (0, 0, 1.0)], queued=0) == 0.75
    assert pool_saturation([(1, 4, 0.9), (1, 4, None)], queued=0) == 0.9  # the queue says 0.25
    assert pool_saturation([(4, 4, 0.2), (4, 4, 0.2)], queued=4) == 1.5


def test_nothing_known_is_no_figure():
    assert pool_saturation([], queued=3) is None  # no replica in rotation
    assert pool_saturation([(2, 0, None)], queued=0) is None  # no limit, no cache reported


def test_a_replica_counts_as_admission_holds_it_measured_or_not():
    measured = ReplicaState(ReplicaSpec("a", "http://a", ("m",), max_in_flight=4), Breaker(5, 10))
    measured.outstanding = 1
    measured.record_metrics({"running": 3.0, "waiting": 1.0}, 100.0)  # three more of others' at the engine
    unmeasured = ReplicaState(ReplicaSpec("b", "http://b", ("m",)), Breaker(5, 10))
    unmeasured.outstanding = 2
    held = [r.held(100.5, 5.0, per_worker=4) for r in (measured, unmeasured)]
    # Everyone's requests against the measured limit (full), this worker's against routing.max_outstanding.
    assert held == [(4.0, 4), (2.0, 4)] and measured.full(100.5, 5.0, 4)
    assert pool_saturation([(*h, None) for h in held], queued=2) == 1.0  # (4 + 2 + 2) / (4 + 4)
