"""Relaying an engine's server-sent events: whole events out as soon as they are whole.

Bytes from the engine are cut at event boundaries (a blank line) and each run
of complete events is sent on at once, in one write; nothing waits for more
than the rest of its own event. The one event the gateway looks inside is the
one carrying `usage`: it is read for metering, and dropped when the client
did not ask for usage (the gateway asked the engine for it on everyone's
behalf). llama.cpp sends one such event per prompt and per choice, each
speaking for its own task, so the relay sums them and counts them; keeping
the last alone billed n=3 choices of 15 tokens as 15. The relay also counts
the deltas it passes on (the events with choices), which is what a stream cut
before its usage events is billed for (see llmgw/gateway/metering.py), and
notes when `[DONE]` has gone out: a client that leaves after it had the whole
answer.
"""

from __future__ import annotations

import json

# An engine that never ends an event must not make the gateway hold its
# output without bound: past this, what is held is sent as it is.
MAX_PENDING = 1 << 20
DONE = b"data: [DONE]\n\n"


def usage_in_event(event: bytes) -> tuple[dict | None, bool]:
    """(usage, usage_only) for one event: usage_only when it has no choices to show."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            data = json.loads(line[5:])
        except ValueError:
            return None, False
        if not isinstance(data, dict):
            return None, False
        usage = data.get("usage")
        return (usage if isinstance(usage, dict) else None), not data.get("choices")
    return None, False


SUMMED = ("prompt_tokens", "completion_tokens")


def _sum(a: dict, b: dict) -> dict:
    """Usage A and B together, as far as both count alike."""
    both = dict(a)
    for key in SUMMED:
        x, y = a.get(key), b.get(key)
        if type(x) is int and type(y) is int:
            both[key] = x + y
    return both


class EventRelay:
    """Feed engine bytes in, get client bytes out; `usage` holds the usage seen, summed over its
    `reports`, `deltas` the events with choices passed on, `done` whether `[DONE]` has."""

    __slots__ = ("pending", "keep_usage", "usage", "reports", "deltas", "done")

    def __init__(self, keep_usage: bool):
        self.pending = b""
        self.keep_usage = keep_usage
        self.usage: dict | None = None
        self.reports = 0
        self.deltas = 0
        self.done = False

    def feed(self, data: bytes) -> bytes:
        pending = self.pending + data if self.pending else data
        end = pending.rfind(b"\n\n")
        if end < 0:
            if len(pending) > MAX_PENDING:
                self.pending = b""
                return pending
            self.pending = pending
            return b""
        out, self.pending = pending[:end + 2], pending[end + 2:]
        events = out.count(b"\n\n")
        if b'"usage"' in out:
            out, usage_only = self._meter(out)
            events -= usage_only
        if out.endswith(DONE):
            events -= 1
            self.done = True
        self.deltas += events
        return out

    def _meter(self, block: bytes) -> tuple[bytes, int]:
        """BLOCK less the usage-only events the client did not ask for, and how many usage-only events it had."""
        kept = []
        usage_only_events = 0
        for event in block.split(b"\n\n")[:-1]:
            # Only the events that name usage are decoded: an engine ahead of the gateway sends a whole
            # stream in one read, and decoding each of its events was a fifth of such a stream's CPU.
            usage, usage_only = usage_in_event(event) if b'"usage"' in event else (None, False)
            if usage is not None:
                self.usage = usage if self.usage is None else _sum(self.usage, usage)
                self.reports += 1
                usage_only_events += usage_only
                if usage_only and not self.keep_usage:
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept), usage_only_events

    def rest(self) -> bytes:
        """What is left when the engine ends the stream without a final blank line."""
        out, self.pending = self.pending, b""
        return out
