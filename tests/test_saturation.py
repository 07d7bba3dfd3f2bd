"""Pool saturation: the worse of a pool's queue and its engines' KV caches, 1.0 at the healthy limit."""

from llmgw.gateway.saturation import pool_saturation


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
