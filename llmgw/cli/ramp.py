"""The search `llmgw ctl bench` makes: the most requests at once a replica serves within a service level.

Pure: it is handed each level's measurement and says which level to measure
next. Levels double from 1 until one breaks, then the gap between the last
that held and the first that broke is halved until it is one request, or 5%
of the level that held: a replica that takes 4 at once is told apart from one
that takes 5, and one that takes 200 is not measured 30 times to tell 200
from 201.

A level holds when every request was answered, the time to first token and
the time per output token, at the SLO's percentile (p90 by default) of the
level's requests, are within the SLO, and it served more than the level
below it did by at least half as much again as the added requests would in
proportion (8 at once after 4 must serve at least 1.5 times the requests a
second). That last rule is the stop when concurrency no longer buys
throughput: past it the requests added mostly wait, and a loose SLO would
otherwise let the ramp climb for as long as the queue grows. A percentile
rather than the mean, and a whole window of requests at each level rather
than a few, so that one slow request does not break a level and a queue
does not hide behind a mean: at p90, a level breaks once more than a tenth of
its requests wait past the SLO.

What is reported is the last level that held, not the peak throughput: the
peak arrives after latency is already unusable. 0 is an answer too: not even
one request at a time is served within the SLO.
"""

from __future__ import annotations

import dataclasses

PRECISION = 0.05  # the search ends when the gap is at most this share of the level that held (or one request)
MIN_GAIN = 0.5  # of the proportional gain in requests a second a higher level must bring


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft: float  # seconds to the first token, at the percentile
    tpot: float  # seconds per output token after the first, at the percentile
    percentile: int = 90


@dataclasses.dataclass(frozen=True)
class Level:
    """One level measured: CONCURRENCY requests kept in flight, and what the measured ones saw."""
    concurrency: int
    samples: int  # requests measured and answered whole
    failed: int  # requests that failed (the level stops at the first)
    ttft: float | None  # seconds, at the SLO's percentile; None: nothing measured
    tpot: float | None  # None: no answer had two tokens to time between
    requests_per_s: float | None  # concurrency over the mean latency (Little's law, closed loop)
    tokens_per_s: float | None
    failure: str | None = None  # the first failure, in words


def judge(level: Level, slo: SLO, below: Level | None) -> str | None:
    """Why LEVEL broke, in words; None when it held. BELOW is the highest level that held under it."""
    if level.failed:
        return f"{level.failed} of {level.failed + level.samples} requests failed: {level.failure}"
    if level.ttft is None or level.requests_per_s is None:
        return "no request was answered"
    p = slo.percentile
    if level.ttft > slo.ttft:
        return f"time to first token p{p} was {level.ttft:.3f} s, over the SLO's {slo.ttft:g} s"
    if level.tpot is not None and level.tpot > slo.tpot:
        return f"time per output token p{p} was {level.tpot * 1000:.1f} ms, over the SLO's {slo.tpot * 1000:g} ms"
    if below is not None and below.requests_per_s and level.concurrency > below.concurrency:
        wanted = below.requests_per_s * (1 + MIN_GAIN * (level.concurrency / below.concurrency - 1))
        if level.requests_per_s < wanted:
            return (f"it served {level.requests_per_s:.2f} requests a second against {below.requests_per_s:.2f} at "
                    f"{below.concurrency} at once, less than {wanted:.2f}: the requests added mostly waited")
    return None


class Ramp:
    """Which level to measure next, and what was found; MOST is the highest level it may try."""

    def __init__(self, slo: SLO, most: int):
        self.slo = slo
        self.most = most
        self.held: Level | None = None  # the highest level that held
        self.broke: Level | None = None  # the lowest level that broke
        self.why: str | None = None  # why that one broke
        self.levels: list[tuple[Level, str | None]] = []  # every level measured, in order, with why it broke

    def next_level(self) -> int | None:
        """The concurrency to measure next; None when the search is over."""
        low = self.held.concurrency if self.held else 0
        if self.broke is None:
            return None if low >= self.most else min(self.most, max(1, low * 2))
        high = self.broke.concurrency
        if low == 0 or high - low <= max(1, int(low * PRECISION)):
            return None
        return (low + high) // 2

    def record(self, level: Level) -> str | None:
        """Take LEVEL's measurement; why it broke, or None when it held."""
        why = judge(level, self.slo, self.held)
        self.levels.append((level, why))
        if why is None:
            if self.held is None or level.concurrency > self.held.concurrency:
                self.held = level
        elif self.broke is None or level.concurrency < self.broke.concurrency:
            self.broke, self.why = level, why
        return why

    @property
    def capacity(self) -> int:
        """The last level that held: 0 when none did."""
        return self.held.concurrency if self.held else 0

    def conclusion(self) -> str:
        """What the search found, in a sentence."""
        if self.held is None:
            return f"not even 1 request at a time is served within the SLO ({self.why})"
        if self.broke is None:
            return (f"{self.held.concurrency} at once held, the most this run tried (--max-concurrency); it may "
                    "take more")
        return f"{self.held.concurrency} at once held; {self.broke.concurrency} broke: {self.why}"
