"""The sign-in throttle: wrong passwords and sign-ups counted per account and per client address, in one
worker's memory.

Two hundred wrong passwords once took 3.4 s, and the right one then worked.
Past `gateway.sign_in_failures_per_account` wrong passwords for one account
from one address, or `gateway.sign_in_failures_per_address` from one address
whatever the accounts, within `gateway.sign_in_window`, the password is not
checked, right or wrong, until the oldest failure leaves the window. The same
holds for the current password a signed-in person gives to change it: a
stolen session must not be a way to guess the password. An unknown account is
counted like a known one, so the refusal tells nobody who has an account.

The account's failures are counted per address it is tried from, not for the
account as a whole. Counted as a whole, twelve wrong passwords from anyone
locked the real administrator out for a quarter of an hour, again and again;
counted per address, a guesser holds back only their own address. The price:
one who controls many addresses gets the account's allowance at each. The
per-address bound caps every address's guesses in all, and an IPv6 address
counts as its /64, the block one host is usually given, so a single machine
cannot step through addresses.

Sign-ups are counted per address too (`gateway.sign_ups_per_address`): each
one hashes a password, and forty at once from one address once made forty
pending accounts in 3.3 s. So are an identity provider's callbacks that do not
end in a session (`gateway.sign_in_failures_per_address`): each asks the
provider, under the client every sign-in shares, and a loop of junk ones
could get that client rate-limited there.

Counted per worker, not in the store: a failure written to SQLite costs a
commit (20-30 ms, fsync included) on the worker's event loop, and a burst of
them stalled every other request as the hashing once did. The price is that
each gateway worker counts alone: with W workers in G gateways an attacker
gets at most W x G times the allowance per window (10 guesses per quarter of
an hour with the defaults and two workers), against thousands unthrottled.
An attempt counts as a failure from the moment it starts, so attempts still
being checked are counted too; a right password takes its own back and
forgives the account's earlier failures from that address.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import math

# Past this many counters held, stale ones are swept out: one attacker cycling through made-up accounts
# must not grow a worker without bound. The next sweep waits until the table doubles, so a table full of
# live entries is not swept on every attempt.
SWEEP_AT = 10_000


@dataclasses.dataclass(frozen=True)
class Limits:
    per_account: int  # wrong passwords for one account from one address
    per_address: int  # wrong passwords from one address
    window: float  # seconds
    sign_ups_per_address: int


def place(address: str) -> str:
    """Where an attempt comes from, as counted: the address, or for IPv6 its /64."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if parsed.version == 4:
        return str(parsed)
    if parsed.ipv4_mapped:
        return str(parsed.ipv4_mapped)
    return str(ipaddress.ip_network(f"{parsed}/64", strict=False))


class Throttle:
    def __init__(self, limits: Limits, refused=lambda limit: None):
        """REFUSED(LIMIT) is told of each attempt held back, by the limit it met: `account`, `address`,
        `sign_up` or `callback` (the pages count them in `llmgw_sign_in_throttled_total`)."""
        self.limits = limits
        self.refused = refused
        self.counted: dict[tuple[str, ...], collections.deque] = {}  # (what, ...) -> times within the window
        self.sweep_at = SWEEP_AT

    def begin(self, email: str, address: str, now: float) -> str | None:
        """Count a password check as a failure until it `succeeded`; or, past a limit, why not, in words for
        the page (and the attempt is not counted: nothing was tried)."""
        account, source = self._account(email, address), ("address", place(address))
        refused = (self._refusal(account, self.limits.per_account, "Too many wrong passwords for this account", now,
                                 "account")
                   or self._refusal(source, self.limits.per_address, "Too many wrong passwords from your address",
                                    now, "address"))
        if refused is None:
            self._count((account, source), now)
        return refused

    def succeeded(self, email: str, address: str, now: float) -> None:
        """A right password: its attempt was no failure, and the account's earlier failures from this
        address are forgiven."""
        self.counted.pop(self._account(email, address), None)
        times = self.counted.get(("address", place(address)))
        if times:
            times.pop()

    def sign_up(self, address: str, now: float) -> str | None:
        """Count a sign-up from ADDRESS; or, past the limit, why not, in words for the sign-up page."""
        key = ("sign-up", place(address))
        refused = self._refusal(key, self.limits.sign_ups_per_address, "Too many sign-ups from your address", now,
                                "sign_up")
        if refused is None:
            self._count((key,), now)
        return refused

    def callback(self, address: str, now: float) -> str | None:
        """Count an identity provider's callback from ADDRESS as unfinished until `callback_finished`; or, past
        `per_address`, why not: each one costs a question to the provider, under the client all sign-ins share."""
        key = ("callback", place(address))
        refused = self._refusal(key, self.limits.per_address, "Too many sign-ins that did not finish from your "
                                                              "address", now, "callback")
        if refused is None:
            self._count((key,), now)
        return refused

    def callback_finished(self, address: str) -> None:
        times = self.counted.get(("callback", place(address)))
        if times:
            times.pop()

    @staticmethod
    def _account(email: str, address: str) -> tuple[str, ...]:
        return "account", email.strip().lower(), place(address)

    def _refusal(self, key: tuple[str, ...], allowed: int, what: str, now: float, limit: str) -> str | None:
        times = self._recent(key, now)
        if len(times) < allowed:
            return None
        self.refused(limit)
        minutes = max(1, math.ceil((times[0] + self.limits.window - now) / 60))
        return f"{what}. Try again in {minutes} minute{'s' if minutes > 1 else ''}."

    def _count(self, keys: tuple[tuple[str, ...], ...], now: float) -> None:
        if len(self.counted) > self.sweep_at:
            self._sweep(now)
            self.sweep_at = max(SWEEP_AT, 2 * len(self.counted))
        for key in keys:
            self.counted.setdefault(key, collections.deque()).append(now)

    def _recent(self, key: tuple[str, ...], now: float) -> collections.deque:
        times = self.counted.get(key, collections.deque())
        while times and times[0] <= now - self.limits.window:
            times.popleft()
        return times

    def _sweep(self, now: float) -> None:
        for key in list(self.counted):
            if not self._recent(key, now):
                del self.counted[key]
