"""The gateway's Prometheus metrics, counted in every worker and summed on one address.

prometheus-client's multi-process mode keeps each worker's figures in files
under `PROMETHEUS_MULTIPROC_DIR`, which must be set before the library is
first imported; `gateway.py` does that. The master serves the sum on
`gateway.metrics_listen` and nothing else there. Gauges about replicas use
`livemax`: a breaker open in any live worker shows as open.

The library cannot remove a series from those files, so a gauge whose figure
a worker no longer knows (a replica gone, a pool with nothing to measure) is
set to `UNKNOWN`, and the master leaves it out. Left as it was, a replica
removed with its breaker open showed open, and alerted, until the worker
restarted.

Counters, histograms and the in-flight gauge are counted in plain Python (a
tally per labelled series) and folded into the library's files by
`GatewayMetrics.fold`, once every FOLD_EVERY seconds and when the worker stops.
Each update of the library's own objects locked, checked the process id and
wrote the memory-mapped file: 6% of a plain request's CPU (docs/performance.md).
A scrape therefore sees a worker's counts up to FOLD_EVERY late. The gauges
set from background greenlets are set on the library's objects directly.
"""

from __future__ import annotations

import glob
import os
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from llmgw.metricsserver import serve_registry

# Below every real figure, so that `livemax` takes any worker's known one over it; never served.
UNKNOWN = float("-inf")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
# Seconds between folds of a worker's counts into prometheus-client's files: the most a scrape lags behind.
FOLD_EVERY = 1.0


class CounterTally:
    """A counter series' increments since the last fold. Its greenlets share it without a lock: gevent
    switches only where one waits, and no update or fold waits."""

    __slots__ = ("target", "pending")

    def __init__(self, target):
        self.target = target
        self.pending = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:  # refused here, at the caller, as prometheus-client refuses it
            raise ValueError(f"a counter only goes up, and was given {amount}")
        self.pending += amount

    def fold(self) -> None:
        if self.pending:
            amount, self.pending = self.pending, 0.0
            self.target.inc(amount)


class GaugeTally(CounterTally):
    """A gauge series moved up and down (requests in flight) since the last fold."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        self.pending += amount

    def dec(self, amount: float = 1) -> None:
        self.pending -= amount


class HistogramTally:
    """A histogram series' observations since the last fold: a count a bucket and their sum."""

    __slots__ = ("target", "bounds", "counts", "sum")

    def __init__(self, target):
        self.target = target
        self.bounds = target._upper_bounds  # ends with +Inf, so every figure has a bucket
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # The first bucket whose bound is at or above AMOUNT, as prometheus-client's observe() finds it.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def fold(self) -> None:
        counts, total = self.counts, self.sum
        if not any(counts):
            return
        self.counts, self.sum = [0] * len(counts), 0.0
        # The library's own per-bucket values (what observe() adds 1 to), each added to once a fold; a test
        # holds the samples equal to observe()'s, so an upgrade that renames them fails there, not in service.
        self.target._sum.inc(total)
        for value, count in zip(self.target._buckets, counts):
            if count:
                value.inc(count)


class Tallied:
    """A labelled metric whose series are tallies: `labels(...)` finds the series in a dict, and makes the
    library's child (checking the labels, as before) only the first time."""

    def __init__(self, metric, tally):
        self.metric = metric
        self.tally = tally
        self.series: dict[tuple, CounterTally | HistogramTally] = {}

    def labels(self, *values):
        found = self.series.get(values)
        if found is None:
            found = self.series[values] = self.tally(self.metric.labels(*values))
        return found

    def fold(self) -> None:
        for series in self.series.values():
            series.fold()


def tallied(metric, tally):
    """METRIC counted through TALLY: a Tallied when it has labels, else the one tally itself."""
    return Tallied(metric, tally) if metric._labelnames else tally(metric)


class GatewayMetrics:
    """The metric objects one worker updates, and `fold`, which its Runtime calls."""

    def __init__(self):
        self.requests = Counter("llmgw_requests", "Requests answered, by model asked for and HTTP status.",
                                ["model", "status"], registry=None)
        self.duration = Histogram("llmgw_request_duration_seconds", "Time from a request's arrival to its last byte.",
                                  ["model"], buckets=LATENCY_BUCKETS, registry=None)
        self.ttft = Histogram("llmgw_ttft_seconds", "Time from a request's arrival to the first token sent to the client.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=None)
        self.tokens = Counter("llmgw_tokens", "Tokens, by model served and direction (in: prompt, out: completion).",
                              ["model", "direction"], registry=None)
        self.in_flight = Tallied(Gauge("llmgw_requests_in_flight", "Requests being answered now.", ["model"],
                                       multiprocess_mode="livesum", registry=None), GaugeTally)
        self.overhead = Histogram("llmgw_gateway_overhead_seconds",
                                  "Time the gateway itself added to a request (before the engine's first byte).",
                                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), registry=None)
        self.retries = Counter("llmgw_upstream_retries", "Attempts retried on another replica, by reason.",
                               ["reason"], registry=None)
        self.engine_deaths = Counter("llmgw_engine_deaths_on_request", "Requests an engine died while answering "
                                     "(not sent to another replica: the request may be what kills engines).",
                                     ["model"], registry=None)
        self.guard_verdicts = Counter("llmgw_guard_verdicts", "Verdicts of guard judges, by judge, what was checked "
                                      "(prompt, answer), verdict (safe, unsafe) and category (S1...; one count per "
                                      "category an unsafe verdict names).", ["judge", "checked", "verdict", "category"],
                                      registry=None)
        self.guard_unavailable = Counter("llmgw_guard_unavailable", "Checks a guard judge could not make (no replica, "
                                         "a failure, a timeout, an unreadable verdict), by judge and guard.fail: with "
                                         "open the request passed unjudged, with closed it was refused with 503.",
                                         ["judge", "fail"], registry=None)
        self.guard_remembered = Counter("llmgw_guard_remembered", "Pieces of a prompt or answer found safe without "
                                        "asking the judge, which had judged the very same piece before (an agent's "
                                        "next turn repeats its conversation), by judge.", ["judge"], registry=None)
        self.guard_duration = Histogram("llmgw_guard_judge_seconds", "Time a guard judge took to give one verdict.",
                                        ["judge"], buckets=LATENCY_BUCKETS, registry=None)
        self.breaker_open = Gauge("llmgw_endpoint_breaker_open", "1 while the replica's circuit breaker is open.",
                                  ["replica"], multiprocess_mode="livemax", registry=None)
        self.metrics_stale = Gauge("llmgw_endpoint_metrics_stale",
                                   "1 while the replica's own load figures are older than routing.metrics_stale_after "
                                   "(it is routed to blind).", ["replica"], multiprocess_mode="livemax", registry=None)
        self.waiting = Gauge("llmgw_endpoint_waiting", "Requests waiting in the replica's engine, as it reports.",
                             ["replica"], multiprocess_mode="livemax", registry=None)
        self.kv_cache = Gauge("llmgw_endpoint_kv_cache_usage", "KV cache use of the replica's engine, 0 to 1.",
                              ["replica"], multiprocess_mode="livemax", registry=None)
        self.limited = Counter("llmgw_requests_limited", "Requests refused by a limit, by kind (rpm, tpm, budget, "
                               "model).", ["limit"], registry=None)
        self.queue_depth = Gauge("llmgw_admission_queue_depth", "Requests waiting in the admission queue for room "
                                 "on a model's replicas, by model and admission band.", ["model", "band"],
                                 multiprocess_mode="livesum", registry=None)
        self.admission_rejected = Counter("llmgw_admission_rejected", "Requests refused with 429 because every "
                                          "replica of the model was busy, by model, admission band and reason (full: "
                                          "gateway.queue_size already waited; waited: no room within "
                                          "gateway.queue_wait; displaced: a better band took its place).",
                                          ["model", "band", "reason"], registry=None)
        self.saturation = Gauge("llmgw_pool_saturation", "How full each model's replicas are, 1.0 at their healthy "
                                "limit: the worse of requests in flight and queued over the admission limit, and "
                                "the engines' mean KV cache use (the worst worker's; absent when neither is known).",
                                ["model"], multiprocess_mode="livemax", registry=None)
        self.client_timeouts = Counter("llmgw_client_timeouts", "Requests cut short because the client was too "
                                       "slow, by phase: answered 408 when it sent them too slowly (head: "
                                       "gateway.header_timeout; body: gateway.body_timeout and "
                                       "gateway.body_min_rate), closed when it did not read its answer (send: "
                                       "gateway.send_timeout).", ["phase"], registry=None)
        self.connections_refused = Counter("llmgw_client_connections_refused", "Connections refused (429, then "
                                           "closed) because their address already held "
                                           "gateway.max_connections_per_address in one worker, none of them idle.",
                                           registry=None)
        self.sign_in_throttled = Counter("llmgw_sign_in_throttled", "Password checks, sign-ups and identity "
                                         "providers' callbacks the throttle refused without trying them, by limit "
                                         "(account: gateway.sign_in_failures_per_account; address and callback: "
                                         "gateway.sign_in_failures_per_address; sign_up: gateway.sign_ups_per_address).",
                                         ["limit"], registry=None)
        self.provider_sign_ins = Counter("llmgw_provider_sign_ins", "Sign-ins through an identity provider (the "
                                         "pages' and llmgw login's), by provider and result: signed_in; waiting "
                                         "(for approval, or for a link to be confirmed); refused (here: a "
                                         "suspension, an unverified address, a state used or not this browser's); "
                                         "provider_failed (it could not be reached, or its answer was not trusted).",
                                         ["provider", "result"], registry=None)
        self.accountant_unavailable = Counter("llmgw_accountant_unavailable",
                                              "Requests that found the accountant unreachable (rate limits waived, "
                                              "budgets refused with 503).", registry=None)
        self.usage_pending = Gauge("llmgw_usage_rows_pending", "Usage rows buffered, not yet in the store.",
                                   multiprocess_mode="livesum", registry=None)
        self.usage_failures = Counter("llmgw_usage_write_failures", "Failed writes of usage batches (rows are kept and retried).",
                                      registry=None)
        self.usage_dropped = Counter("llmgw_usage_rows_dropped", "Usage rows given up on, each logged with its "
                                     "content: refused by the store for what they hold, or left at exit when "
                                     "neither the store nor the spool could be written.", registry=None)
        self.controller_dropped = Counter("llmgw_controller_messages_dropped", "Messages from the controller that "
                                          "could not be read (malformed, or of a protocol version this gateway does "
                                          "not know), and so were not acted on.", registry=None)
        # Every counter and histogram is tallied too (the module's first lines say why); the gauges set from
        # background greenlets stay the library's own, and so do the usage writer's counters: on SQLite it
        # counts from a thread of its own (offloop.py), where a tally's += could race the fold, and the
        # library's values take a lock. They count failures, rare enough for the library's cost.
        tallies = {Counter: CounterTally, Histogram: HistogramTally}
        for name, metric in list(vars(self).items()):
            if type(metric) in tallies and name not in ("usage_failures", "usage_dropped"):
                setattr(self, name, tallied(metric, tallies[type(metric)]))
        self.folded = [m for m in vars(self).values() if isinstance(m, (Tallied, CounterTally, HistogramTally))]

    def fold(self) -> None:
        """Add what was counted since the last fold to prometheus-client's files, where scrapes read it."""
        for metric in self.folded:
            metric.fold()


class _Known:
    """The workers' summed metrics, less the gauges they set to UNKNOWN."""

    def __init__(self, path: str):
        self.path = path  # prometheus-client's multi-process directory, where each worker writes its files

    def collect(self):
        # A worker booting creates its files empty before it maps them: read then, the library's collect raised
        # (struct.error) and the scrape got a 500. Such a file holds nothing yet; it is read at the next scrape.
        files = [path for path in glob.glob(os.path.join(self.path, "*.db")) if _size(path) >= 8]
        for family in multiprocess.MultiProcessCollector.merge(files, accumulate=True):
            if family.type == "gauge":
                family.samples = [s for s in family.samples if s.value != UNKNOWN]
            yield family


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # gone since it was listed: a worker's files are removed when it is marked dead
        return 0


def serve(listen: str) -> None:
    """Serve the gateway workers' summed metrics on LISTEN (`host:port`) from the master."""
    registry = CollectorRegistry()
    registry.register(_Known(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
    serve_registry(listen, registry)


def worker_gone(pid: int) -> None:
    multiprocess.mark_process_dead(pid)
