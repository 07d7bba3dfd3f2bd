"""A circuit breaker for one replica: repeated failures take it out of rotation.

Closed: requests flow. After `failures` consecutive failures it opens, and no
request is sent to it. Once `cooldown` has passed, the replica is due a probe
(`GET /health`, sent by the worker's watcher, never a client's request); a good
probe closes the breaker, a bad one keeps it open and doubles the wait, up to
`MAX_COOLDOWN`. Pure state and arithmetic: the caller brings the clock.
"""

from __future__ import annotations

MAX_COOLDOWN = 300.0


class Breaker:
    __slots__ = ("threshold", "base_cooldown", "failures", "opened_at", "cooldown")

    def __init__(self, threshold: int, cooldown: float):
        self.threshold = threshold
        self.base_cooldown = cooldown
        self.failures = 0
        self.opened_at: float | None = None
        self.cooldown = cooldown

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def success(self) -> None:
        self.failures = 0
        if self.opened_at is not None:
            self.opened_at = None
            self.cooldown = self.base_cooldown

    def failure(self, now: float) -> bool:
        """Count a failure; True when this one opened the breaker."""
        self.failures += 1
        if self.opened_at is None and self.failures >= self.threshold:
            self.opened_at = now
            return True
        return False

    def probe_due(self, now: float) -> bool:
        return self.opened_at is not None and now - self.opened_at >= self.cooldown

    def probe_failed(self, now: float) -> None:
        self.opened_at = now
        self.cooldown = min(self.cooldown * 2, MAX_COOLDOWN)
