"""The load `llmgw ctl bench` sends: streamed chat requests through a gateway to one replica, timed.

Each request names its replica (`X-Llmgw-Replica`, which the gateway lets
only an administrator's key send) and asks for a fixed number of tokens
(`ignore_eos`, which llama.cpp, vLLM and SGLang read), so that every request
of a level is the same work. Its prompt starts with random characters: the
engine's prefix cache would otherwise answer every request after the first
from memory, and the bench would measure the cache rather than the replica.

Time to first token is from sending to the first token's event; time per
output token is the time from the first token to the last over the tokens
between them. Requests go through the gateway, as every client's do: what is
measured includes its admission, routing and relay, and the key's limits
hold the bench as they hold anyone.
"""

from __future__ import annotations

import http.client
import json
import secrets
import threading
import time
import urllib.parse

from llmgw.cli.ramp import Level
from llmgw.loadloop import closed_loop, percentile

PATH = "/v1/chat/completions"
WORDS = ("the", "cluster", "serves", "models", "on", "its", "own", "machines", "and", "every", "request", "waits")
# What a gateway answers that no level changes: the bench would fail the same way at every level, so it
# stops and says why rather than report a capacity of 0.
REFUSALS = {"invalid_api_key", "missing_api_key", "revoked_api_key", "expired_api_key", "account_inactive",
            "model_not_found", "model_not_allowed", "replica_not_found", "replica_choice_not_allowed",
            "rate_limit_exceeded", "tokens_limit_exceeded", "budget_exhausted", "limits_unavailable",
            "catalog_unknown", "content_filter"}
LIMITS = {"rate_limit_exceeded", "tokens_limit_exceeded", "budget_exhausted"}


class Refused(Exception):
    """The gateway refused the bench's requests for a reason no level changes; the message says what to do."""


class Failed(Exception):
    """One request failed under load: the level it was part of broke."""


class Closed(OSError):
    """The connection was closed before the request got any answer."""


class Target:
    """Where the bench's requests go, and what each asks for."""

    def __init__(self, gateway: str, key: str, model: str, replica: str, max_tokens: int, prompt_words: int,
                 timeout: float):
        url = urllib.parse.urlsplit(gateway)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{gateway} is not an http(s) URL such as http://gateway:8080")
        self.gateway = gateway
        self.https = url.scheme == "https"
        self.host, self.port = url.hostname, url.port
        self.base = url.path.rstrip("/")
        self.model, self.replica = model, replica
        self.max_tokens = max_tokens
        self.filler = " ".join(WORDS[i % len(WORDS)] for i in range(prompt_words))
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                        "Accept": "text/event-stream", "X-Llmgw-Replica": replica}

    def connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.timeout)

    def body(self) -> bytes:
        return json.dumps({"model": self.model, "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": f"{secrets.token_hex(8)} {self.filler}"}]}).encode()

    def one(self, conn: http.client.HTTPConnection) -> tuple[float, float | None, float, int]:
        """One request on CONN: (time to first token, time per output token or None, latency, tokens).
        Raises Failed, Refused, or OSError and http.client's errors for the connection."""
        sent = time.perf_counter()
        try:
            conn.request("POST", self.base + PATH, self.body(), self.headers)
            resp = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
            raise Closed(str(e) or type(e).__name__) from None
        if resp.status != 200:
            self._refusal(resp.status, resp.read())
        first = last = None
        events = 0
        usage = None
        done = False
        for line in resp:
            if not line.startswith(b"data:"):
                continue  # a comment (`: loading`) or the blank line between events
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            try:
                event = json.loads(payload)
            except ValueError:
                raise Failed("the stream carried an event that is not JSON") from None
            if isinstance(event, dict) and event.get("error"):
                error = event["error"]
                raise Failed(f"the stream ended with an error: {error.get('message', error)}"
                             if isinstance(error, dict) else "the stream ended with an error")
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                    last = time.perf_counter()
                    first = first or last
                    events += 1
            if isinstance(event.get("usage"), dict):
                usage = event["usage"].get("completion_tokens")
        resp.read()  # the end of the chunked body, so the connection can carry the next request
        if not done:
            raise Failed("the stream ended before its [DONE]")
        if first is None:
            raise Failed("the answer held no token")
        tokens = usage if isinstance(usage, int) and usage >= events else events
        tpot = (last - first) / (tokens - 1) if tokens > 1 else None
        return first - sent, tpot, time.perf_counter() - sent, tokens

    def _refusal(self, status: int, data: bytes):
        """Raise what a non-200 answer means: Refused when no level would change it, Failed otherwise."""
        try:
            error = json.loads(data)["error"]
            code, message = error.get("code"), error.get("message")
        except (ValueError, KeyError, TypeError, AttributeError):
            code, message = None, data[:200].decode("utf-8", "replace")
        if code in REFUSALS or status in (400, 401, 403, 404):
            extra = (" The bench is held to its key's limits like anyone: use a key whose limits allow it, or "
                     "raise them (`llmgw limits ...`)." if code in LIMITS else "")
            raise Refused(f"the gateway at {self.gateway} refused the bench's request ({status}): {message}{extra}")
        raise Failed(f"HTTP {status} {code or ''}".rstrip() + (f": {message[:200]}" if message else ""))


def measure(target: Target, concurrency: int, wanted: int, at_percentile: int) -> Level:
    """Keep CONCURRENCY requests in flight until WANTED have been measured (or one failed); each client's
    first request is not measured, since a level's first requests all arrive at once. Raises Refused."""
    lock = threading.Lock()
    mine = threading.local()
    started = [0]
    samples: list[tuple[float, float | None, float, int]] = []
    failures: list[str] = []
    refusals: list[str] = []

    def one() -> bool:
        with lock:
            go = not (failures or refusals or started[0] >= wanted)
            warm = getattr(mine, "warm", False)
            started[0] += go and warm
        if not go:
            if getattr(mine, "conn", None) is not None:
                mine.conn.close()
            return False
        try:
            try:
                sample = target.one(connection())
            except Closed:
                if not mine.reused:
                    raise
                # A kept-alive connection the gateway closed as this request left (an idle timeout, a worker
                # restarting): nothing was answered, so the request goes once more on a new connection.
                mine.conn.close()
                mine.conn = None
                sample = target.one(connection())
        except (Refused, Failed, OSError, http.client.HTTPException) as e:
            if isinstance(e, Refused):
                refusals.append(str(e))
            elif isinstance(e, Failed):
                failures.append(str(e))
            else:
                failures.append(f"the connection to the gateway failed: {e or type(e).__name__}")
            mine.conn.close()
            return False
        if warm:
            samples.append(sample)
        mine.warm = mine.reused = True
        return True

    def connection() -> http.client.HTTPConnection:
        if getattr(mine, "conn", None) is None:
            mine.conn, mine.reused = target.connect(), False
        return mine.conn

    closed_loop(concurrency, one)
    if refusals:
        raise Refused(refusals[0])
    latencies = [s[2] for s in samples]
    mean = sum(latencies) / len(latencies) if latencies else None
    tokens = sum(s[3] for s in samples)
    return Level(concurrency=concurrency, samples=len(samples), failed=len(failures),
                 ttft=percentile([s[0] for s in samples], at_percentile),
                 tpot=percentile([s[1] for s in samples if s[1] is not None], at_percentile),
                 requests_per_s=concurrency / mean if mean else None,
                 tokens_per_s=concurrency * tokens / sum(latencies) if latencies else None,
                 failure=failures[0] if failures else None)
