"""The sign-in throttle: failed sign-ins counted per account and per client address, in one worker's memory.

Two hundred wrong passwords once took 3.4 s, and the right one then worked.
Past `gateway.sign_in_failures_per_account` failures for one account, or
`gateway.sign_in_failures_per_address` from one address, within
`gateway.sign_in_window`, sign-in is refused before any password is checked,
right or wrong, until the oldest failure leaves the window. An unknown
account is counted like a known one, so the refusal tells nobody who has an
account.

Counted per worker, not in the store: a failure written to SQLite costs a
commit (20-30 ms, fsync included) on the worker's event loop, and a burst of
them stalled every other request as the hashing once did. The price is that
each gateway worker counts alone: with W workers in G gateways an attacker
gets at most W x G times the allowance per window (10 guesses per quarter of
an hour with the defaults and two workers), against thousands unthrottled.
An attempt counts as a failure from the moment it starts, so attempts still
being checked are counted too; a right password takes its own back and
forgives the account's earlier failures.
"""

from __future__ import annotations

import collections
import dataclasses
import math

# Past this many accounts and addresses held, stale ones are swept out: one attacker cycling through
# made-up addresses must not grow a worker without bound. The next sweep waits until the table doubles,
# so a table full of live entries is not swept on every attempt.
SWEEP_AT = 10_000


@dataclasses.dataclass(frozen=True)
class Limits:
    per_account: int
    per_address: int
    window: float  # seconds


class Throttle:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.failures: dict[tuple[str, str], collections.deque] = {}  # ("account"|"address", value) -> times
        self.sweep_at = SWEEP_AT

    def begin(self, email: str, address: str, now: float) -> str | None:
        """Count an attempt as a failure until it `succeeded`; or, past a limit, why not, in words for the
        sign-in page (and the attempt is not counted: nothing was tried)."""
        if len(self.failures) > self.sweep_at:
            self._sweep(now)
            self.sweep_at = max(SWEEP_AT, 2 * len(self.failures))
        account, place = ("account", email.strip().lower()), ("address", address)
        for key, allowed, what in ((account, self.limits.per_account, "for this account"),
                                   (place, self.limits.per_address, "from your address")):
            times = self._recent(key, now)
            if len(times) >= allowed:
                minutes = max(1, math.ceil((times[0] + self.limits.window - now) / 60))
                return f"Too many failed sign-ins {what}. Try again in {minutes} minute{'s' if minutes > 1 else ''}."
        for key in (account, place):
            self.failures.setdefault(key, collections.deque()).append(now)
        return None

    def succeeded(self, email: str, address: str, now: float) -> None:
        """A right password: its attempt was no failure, and the account's earlier failures are forgiven."""
        self.failures.pop(("account", email.strip().lower()), None)
        times = self.failures.get(("address", address))
        if times:
            times.pop()

    def _recent(self, key: tuple[str, str], now: float) -> collections.deque:
        times = self.failures.get(key, collections.deque())
        while times and times[0] <= now - self.limits.window:
            times.popleft()
        return times

    def _sweep(self, now: float) -> None:
        for key in list(self.failures):
            if not self._recent(key, now):
                del self.failures[key]
