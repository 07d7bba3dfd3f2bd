"""Who a request is from and what it may spend: a key, or a signed-in person on the chat page.

A `Caller` carries the principal's `rules.Access` through the `/v1` pipeline,
the reservation the accountant granted it, and what the accountant said about
the pools it was counted in, which becomes OpenAI's rate-limit headers.
"""

from __future__ import annotations

from llmgw.rules import Access, Price, show_money


def duration(seconds: int) -> str:
    """SECONDS in words for a refusal: how long until a budget starts again."""
    if seconds >= 86400:
        return f"{seconds // 86400} d {seconds % 86400 // 3600} h"
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    return f"{max(1, seconds // 60)} min"


class Caller:
    """Who a request is from and what it may spend: a key, or a signed-in person on the chat page."""

    __slots__ = ("key_id", "project_id", "user_id", "access", "wire", "price", "reservation", "status")

    def __init__(self, key_id: str, project_id: str | None, user_id: str | None, access: Access):
        self.key_id = key_id
        self.project_id = project_id
        self.user_id = user_id
        self.access = access
        self.wire = access.wire
        self.price: Price | None = None
        self.reservation = None  # what the limiter settles: a reservation's id, or a ticket of an allowance
        self.status: dict = {}

    # The last status the headers were made from, whether they showed the budget, and the headers. The requests
    # an allowance admits share its status (llmgw/gateway/limiter.py), so one at a time and at 32 clients nearly
    # every limited request finds its headers here: the budget's, formatted as money, cost 2% of its CPU.
    _last: tuple = (None, False, [])

    def limit_headers(self) -> list[tuple[str, str]]:
        """OpenAI's rate-limit headers, from the pool nearest to refusing, and the budget left. The list may be
        another request's too: callers copy it into their own, never change it."""
        if not self.status:
            return []  # nothing limits the caller (or nothing was said): nothing to show, and the last kept
        budget = self.price is not None and not self.price.zero()
        status, shown, headers = Caller._last
        if status is self.status and shown == budget:
            return headers
        out = []
        for name, kind in (("rpm", "requests"), ("tpm", "tokens")):
            if name in self.status:
                limit, remaining = self.status[name]
                out += [(f"X-RateLimit-Limit-{kind.capitalize()}", str(limit)),
                        (f"X-RateLimit-Remaining-{kind.capitalize()}", str(remaining))]
        if "budget" in self.status and budget:
            _limit, remaining = self.status["budget"]
            out.append(("X-Llmgw-Budget-Remaining", show_money(remaining)))
        Caller._last = (self.status, budget, out)
        return out
