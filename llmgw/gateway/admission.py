"""Waiting for a saturated model: a bounded queue per model, in order of admission band.

A model is saturated when every replica in rotation is full (at the
requests in flight its profile was measured to take, `llmgw ctl bench
--save`, everyone's counted; not measured, at `routing.max_outstanding` of
this worker's: `balancer.ReplicaState.full`), or when every replica tried
answered "busy" (429). A request for it then waits here instead of
being refused at once. Whenever a request on the model ends, the waiter with
the best band (high, then normal, then low; first come first within one) is
woken to try; the others keep waiting. Bands come from the key and its
scopes (`rules.Access.band`), never from the request.

The queue is bounded (`gateway.queue_size` per model). When it is full, a
newcomer in a better band than the worst waiter takes that waiter's place,
and the worst waiter is refused; otherwise the newcomer is refused. A waiter
that has waited `gateway.queue_wait` seconds is refused too. Each refusal is
a 429 with Retry-After, and counted by the reason (`full`, `waited`, `displaced`)
and the band it was in.

The queue is per worker, like the load it reacts to: each worker sees its
own requests' outstanding count, and a request never waits on a lock shared
between processes.
"""

from __future__ import annotations

import heapq
import itertools
import time

from gevent.event import Event

from llmgw.rules import BANDS

RANK = {band: i for i, band in enumerate(BANDS)}
RECHECK = 0.25  # seconds: a waiter looks again even unwoken (capacity can free up on another worker's side)


FULL, WAITED, DISPLACED = "full", "waited", "displaced"  # why a request was refused, as its metric says


class Refused(Exception):
    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class _Waiter:
    __slots__ = ("rank", "seq", "event", "evicted")

    def __init__(self, rank: int, seq: int):
        self.rank = rank
        self.seq = seq
        self.event = Event()
        self.evicted = False

    def __lt__(self, other: "_Waiter") -> bool:
        return (self.rank, self.seq) < (other.rank, other.seq)


class AdmissionQueue:
    def __init__(self, size: int, wait: float):
        self.size = size
        self.wait = wait
        self.queues: dict[str, list[_Waiter]] = {}
        self.seq = itertools.count()

    def waiting(self, model: str) -> int:
        return len(self.queues.get(model, ()))

    def depth(self, model: str) -> dict[str, int]:
        """Requests waiting for MODEL, by band (every band, 0 where none waits)."""
        counts = dict.fromkeys(BANDS, 0)
        for waiter in self.queues.get(model, ()):
            counts[BANDS[waiter.rank]] += 1
        return counts

    def wait_turn(self, model: str, band: str, has_room, wait_first: bool = False) -> None:
        """Return when HAS_ROOM() is true and this request is first in line; raise Refused otherwise.
        WAIT_FIRST: wait for a wake-up (or a recheck) even with nobody in line."""
        queue = self.queues.setdefault(model, [])
        if not queue and not wait_first and has_room():
            return
        me = _Waiter(RANK.get(band, RANK["normal"]), next(self.seq))
        if len(queue) >= self.size:
            worst = max(queue)
            if self.size == 0 or worst < me:
                raise Refused(f"{self.size} requests already wait for this model", FULL)
            queue.remove(worst)
            heapq.heapify(queue)
            worst.evicted = True
            worst.event.set()
        heapq.heappush(queue, me)
        deadline = time.monotonic() + self.wait
        try:
            while True:
                if queue[0] is me and not wait_first and has_room():
                    return
                wait_first = False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Refused(f"no replica had room within {self.wait:.0f} s", WAITED)
                me.event.wait(min(RECHECK, left))
                me.event.clear()
                if me.evicted:
                    raise Refused("requests in a higher admission band took its place in the queue", DISPLACED)
        finally:
            if not me.evicted and me in queue:
                queue.remove(me)
                heapq.heapify(queue)
            if queue:
                queue[0].event.set()  # the next in line looks now rather than at its next recheck

    def release(self, model: str) -> None:
        """A request on MODEL ended: wake the first in line."""
        queue = self.queues.get(model)
        if queue:
            queue[0].event.set()
