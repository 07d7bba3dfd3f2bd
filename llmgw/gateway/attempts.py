"""Attempts: a request sent to a replica of its model, and to another when the first cannot serve it.

Whose fault, and what follows. What says the replica is unwell (no
connection, a connect timeout, silence mid-answer, a connection cut
mid-answer, a 502, 503 or 504: the engine, or something in front of it,
cannot serve now) counts against its breaker and, before anything has reached
the client, is tried again on another replica, up to `routing.attempts` (or
the request's routing profile's `attempts`; its timeouts likewise).
A request that runs past `timeouts.first_byte` or `timeouts.total` is not such
evidence: a long answer (`max_tokens` 400 with `ignore_eos`, not streamed)
starts only when it ends, and six of them opened a breaker that every other
client was being served through, each retried on three replicas. Such a
timeout is neither retried nor counted; it prompts a health check of the
replica, as a 500 does (below). What the engine answers to the
request itself is never retried and never counted against the replica: a 4xx
is the engine refusing the request, and a 500 is, as often as not, the
request too (llama.cpp answers 500 to tools that are not a list, a message
name that is an object, a text part without text). Counting those let one
key's bad requests open every replica's breaker and take a model offline for
everyone, each bad request striking three replicas on its retries. A 500 is
passed on as a 502 and prompts a health check of the replica instead: a
failed check is a strike, so an engine that fails every request because it is
sick still leaves rotation, found by a probe no client's request can fail.
What is lost: a replica whose health check passes while it fails or hangs
every request stays in rotation (its 502s and 504s show in the metrics and the
log), and a hung one whose check fails leaves only after `breaker.failures`
checks, at most one every HEALTH_CHECK_EVERY seconds.

An engine that hangs up on a request and then fails its health check died
holding it, perhaps of it: that request is not sent to another replica (one
request once took down every replica it was retried on).

A request for a model whose replicas are all full waits its turn in the admission queue
(llmgw/gateway/admission.py), by band, rather than being refused at once.
"""

from __future__ import annotations

import json
import logging
import re
import time

import gevent

from llmgw.gateway import admission, apirequest
from llmgw.gateway.billing import Billing
from llmgw.gateway.errors import ApiError
from llmgw.gateway.exchange import Exchange
from llmgw.gateway.snapshot import ModelSpec
from llmgw.gateway.upstream import Cancel, UpstreamError
from llmgw.gateway.worker import Runtime

log = logging.getLogger("llmgw.proxy")  # every step of the request path logs as one, as it did

HEALTH_CHECK_EVERY = 2.0  # seconds: engine errors on a replica prompt at most one health check this often
UNAVAILABLE = (502, 503, 504)  # what an engine (or a proxy in front of it) answers when it cannot serve now
# Timeouts the request's own length can cause: checked against the replica's health, never struck or retried.
REQUEST_TIMEOUTS = ("first_byte", "total")
# What engines say when a request does not fit the model's context: llama.cpp
# ("exceed_context_size_error", "exceeds the available context size"), vLLM ("maximum context
# length"), SGLang ("exceeds the maximum allowed length").
CONTEXT_EXCEEDED = re.compile(rb"exceed_context_size|exceeds the available context|maximum context length|"
                              rb"exceeds the maximum allowed length")
# An engine's error type, passed on as the code when it looks like one (it names a kind, never the request).
ENGINE_CODE = re.compile(r"[a-z_]{1,40}")


# What a client is told of an engine's failure. The UpstreamError's own text
# names the engine's host and port and may quote its answer; that goes to the
# log, under the request id the client's error ends with.
FAILURES = {
    "first_byte": "it did not start its answer within timeouts.first_byte (or its routing profile's first_byte)",
    "idle": "it sent nothing for longer than timeouts.idle (or its routing profile's idle)",
    "total": "the answer took longer than timeouts.total (or its routing profile's total) allows",
    "connect": "it could not be reached",
    "closed": "it closed the connection before the answer was complete",
    "status": "it is unavailable",
    "protocol": "its answer could not be read",
    "abandoned": "its replica was taken out of rotation while the request waited on it",
}


def upstream_error(model: str, e: UpstreamError) -> ApiError:
    if e.phase == "busy":
        return ApiError(429, f"Every replica of {model} tried is at capacity. Retry after {e.retry_after} s.",
                        "engine_at_capacity", retry_after=e.retry_after)
    what = FAILURES.get(e.phase, "it failed")
    if e.phase in ("first_byte", "idle", "total"):
        return ApiError(504, f"The engine for {model} timed out: {what}. Try again; if it keeps happening, the "
                             "model may be overloaded or the timeouts.* settings too short.", "upstream_timeout")
    return ApiError(502, f"The engine for {model} failed: {what}. Try again; if it persists, an operator can "
                         "find the cause in the gateway's log under the request id.", "upstream_error")


def _engine_code(detail: bytes) -> str | None:
    """The error type in an engine's error body, when it is a plain identifier."""
    try:
        error = json.loads(detail).get("error")
    except (ValueError, AttributeError):
        return None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) and ENGINE_CODE.fullmatch(kind) else None


def _retry_after(value: str | None) -> int:
    try:
        return max(1, int(value)) if value else 1
    except ValueError:
        return 1


class ClientLeft(ApiError):
    """The client closed its connection before its answer came: nothing more is done for it. TOKENS: what is
    billed for the prompt the replica that had it read (None where none had it; the exchange names it)."""

    def __init__(self, tokens: tuple[int, int | None] | None):
        super().__init__(499, "The client closed the connection before the answer came.", "client_closed_request")
        self.tokens = tokens


class Attempts:
    def __init__(self, runtime: Runtime, billing: Billing):
        self.rt = runtime
        self.billing = billing  # what a client that left while the engine had its request is billed
        self.queue = runtime.queue

    def connect_in_turn(self, ex: Exchange, pin=None, cancel: Cancel | None = None):
        """`_connect` for EX's request, but a request for a saturated model waits its turn in the admission queue
        rather than being refused at once (see llmgw/gateway/admission.py). A request that names its replica
        (PIN) waits for nothing: it is a measurement of that replica, answered or refused by it. CANCEL: as
        for `_connect`; a request whose client left while it waited its turn goes no further."""
        if pin is not None:
            return self._connect(ex, pin, cancel)
        model = ex.model
        deadline = time.monotonic() + self.queue.wait
        band = ex.caller.access.band
        router = self.rt.router
        while True:
            if router.limited(model.name):
                self._turn(model, band, lambda: router.has_room(model.name, time.monotonic()))
            if cancel is not None and cancel.cancelled:
                raise ClientLeft(None)
            try:
                return self._connect(ex, None, cancel)
            except ApiError as e:
                if e.code != "engine_at_capacity" or time.monotonic() >= deadline:
                    raise
            # Every replica said busy: wait for a request on the model to end (or a recheck), then try again.
            self._turn(model, band, lambda: True, wait_first=True)

    def _turn(self, model: ModelSpec, band: str, has_room, wait_first: bool = False) -> None:
        try:
            self.queue.wait_turn(model.name, band, has_room, wait_first)
        except admission.Refused as e:
            self.rt.metrics.admission_rejected.labels(model.name, band, e.kind).inc()
            raise ApiError(429, f"Every replica of {model.name} is busy and this request could not wait: {e.reason}. "
                                "Retry shortly.", "model_saturated", retry_after=2) from None

    def _connect(self, ex: Exchange, pin=None, cancel: Cancel | None = None):
        """Try replicas until one answers EX's request: (response, replica, whole body or None for a stream,
        overhead ms), the replica named in EX; only PIN, once, when the request named it. CANCEL
        (upstream.Cancel), aborted when the client leaves, ends the attempt; the request then goes to no
        other replica (ClientLeft).

        Raises ApiError when every attempt failed or no replica is in rotation.
        """
        rt = self.rt
        req, model = ex.req, ex.model
        router = rt.router
        path = apirequest.PATHS[req.kind]
        body = req.upstream_body(model.name)
        profile = ex.profile = rt.profiles.of(ex.caller.access.profile, model.routing_profile)
        deadline = time.monotonic() + profile.total
        tried: set[str] = set()
        failure: UpstreamError | None = None
        engine_time = 0.0
        for _ in range(profile.attempts if pin is None else 1):
            replica = pin or router.pick(model.name, time.monotonic(), req.affinity, tried, req.follows, profile)
            if replica is None:
                break
            if failure is not None:
                rt.metrics.retries.labels(failure.phase).inc()
            tried.add(replica.spec.id)
            # The replica's count of this worker's requests on it is raised here and lowered in this
            # `finally` however the attempt ends, a bug included; only a stream handed on keeps it, and the
            # stream lowers it when it ends (forward.py's Relay).
            replica.outstanding += 1
            handed_on = False
            sent = time.perf_counter()
            try:
                if cancel is not None:
                    cancel.abandoned = False
                    replica.unanswered.add(cancel)
                try:
                    resp, data = self._ask(replica, path, body, deadline, req.stream, cancel, profile)
                except UpstreamError as e:
                    engine_time += time.perf_counter() - sent
                    if cancel is not None and cancel.cancelled:
                        # The engine read the prompt, maybe more: billed as a stream cut before its first token.
                        ex.replica = replica.spec.id
                        raise ClientLeft(self.billing.billed(req, model, replica, None, 0)) from None
                    if cancel is not None and cancel.abandoned:
                        # The replica left rotation while this waited on it: nothing reached the client, and
                        # the replica is already out, so the request goes to another one, with no strike.
                        log.warning("a request on replica %s (%s) for %s was moved: the replica left rotation "
                                    "while it waited for an answer", replica.spec.id, replica.spec.url, model.name)
                        failure = UpstreamError("abandoned",
                                                "the replica left rotation while the engine had the request")
                        continue
                    # A full engine is routine under load (and queued for, below); a failure is worth a line.
                    log.log(logging.DEBUG if e.phase == "busy" else logging.WARNING,
                            "an attempt on replica %s (%s) for %s failed: %s", replica.spec.id, replica.spec.url,
                            model.name, e)
                    failure = e
                    if e.phase == "busy":
                        continue
                    self.blame(replica, e)
                    if e.phase in REQUEST_TIMEOUTS:
                        break  # this request would run as long on any replica
                    if e.phase == "closed" and self.rt._get(replica, "/health") is None:
                        raise self._fatal_request(model.name, replica) from None
                    continue
                finally:
                    if cancel is not None:
                        replica.unanswered.discard(cancel)
                engine_time += time.perf_counter() - sent
                if resp.status >= 400:
                    resp.release()
                    raise self._engine_refusal(model, replica, resp.status, data)
                replica.breaker.success()
                overhead = (time.perf_counter() - ex.t0 - engine_time) * 1000
                rt.metrics.overhead.observe(overhead / 1000)
                if data is None:
                    handed_on = True
                else:
                    resp.release()
                rt.used(model.name)
                ex.replica = replica.spec.id
                return resp, replica, data, overhead
            finally:
                if not handed_on:
                    replica.outstanding -= 1
        if failure is None:
            configured = len(router.snapshot.replicas_for(model.name))
            if configured:
                raise ApiError(503, f"No replica of {model.name} is in rotation: all {configured} failed recently "
                                    "and are waiting to be probed. Try again in a few seconds.",
                               "no_replica_ready", retry_after=max(1, int(rt.cfg["breaker.cooldown"])))
            raise ApiError(503, f"{model.name} has no replica running. Try again shortly; an operator can check "
                                "that its engines are up.", "no_replica_ready", retry_after=5)
        raise upstream_error(model.name, failure)

    def _ask(self, replica, path: str, body: bytes, deadline: float, stream: bool, cancel: Cancel | None, profile):
        """Send the request to REPLICA: (response, its whole body), the body None for a stream that started.
        Raises UpstreamError for an engine that is full, unavailable, or failed before the answer was whole."""
        idle = profile.idle
        resp = self.rt.pool.request(replica.target, "POST", path, body, profile.first_byte, deadline, cancel=cancel)
        if resp.status == 429:
            # The engine is full, not broken: another replica may have room, and the breaker is left alone.
            resp.read(idle)
            resp.release()
            raise UpstreamError("busy", "it is at capacity (429)",
                                retry_after=_retry_after(resp.headers.get("retry-after")))
        if resp.status in UNAVAILABLE:
            detail = resp.read(idle)[:200].decode("utf-8", "replace")
            resp.release()
            raise UpstreamError("status", f"it answered {resp.status} {detail}".strip())
        # A whole answer is read here, inside the attempt: if the engine fails halfway, nothing has reached
        # the client yet and another replica can still be tried.
        data = None if stream and resp.status < 400 else resp.read(idle)
        if cancel is not None:
            cancel.conn = None  # the answer is in (or the stream's own watch takes over): nothing to abort
        return resp, data

    def blame(self, replica, e: UpstreamError) -> None:
        """Count E against REPLICA, or, for a timeout the request itself may cause, check its health."""
        if e.phase in REQUEST_TIMEOUTS:
            self._check_soon(replica)
        else:
            self._strike(replica, e)

    def _check_soon(self, replica) -> None:
        if replica.check_due(time.monotonic(), HEALTH_CHECK_EVERY):
            gevent.spawn(self._check_health, replica)

    def _strike(self, replica, e: UpstreamError) -> None:
        if replica.breaker.failure(time.monotonic()):
            log.warning("replica %s is out of rotation after %d failures in a row (last: %s)",
                        replica.spec.id, replica.breaker.failures, e)
            replica.leave()

    def _engine_refusal(self, spec: ModelSpec, replica, status: int, detail: bytes) -> ApiError:
        """The client's error for an engine's answer to the request itself (a 4xx, or a 500 and kin).

        Neither is retried nor counted against the replica (see the top of this module). The engine's
        own words often quote the request, and name the replica; they go to the log, not to the client.
        What a client can act on is said in the gateway's words: a prompt too long for the model's
        context (coding agents hit it first, and without the reason they retried it six times).
        """
        model = spec.name
        log.warning("replica %s (%s) of %s answered %d to a request: %s", replica.spec.id, replica.spec.url, model,
                    status, detail[:300].decode("utf-8", "replace"))
        if status == 400 and CONTEXT_EXCEEDED.search(detail[:2000]):
            size = f" of {spec.max_context} tokens" if spec.max_context else ""
            return ApiError(400, f"The request does not fit {model}'s context{size}: the prompt and the tokens "
                                 "asked for are too many. Send a shorter conversation (fewer or shorter "
                                 "messages, tools or instructions), or ask for fewer output tokens.",
                            "context_length_exceeded", "messages")
        if status < 500:
            return ApiError(status, f"The engine for {model} refused this request (HTTP {status}). Check it "
                                    "against the API reference; the engine's own words, which may quote the "
                                    "request, are in the gateway's log under the request id.",
                            _engine_code(detail) or "engine_refused")
        self._check_soon(replica)
        return ApiError(502, f"The engine for {model} failed on this request (HTTP {status}); it was not tried "
                             "on another replica, as an error a request causes recurs on every one. Check the "
                             "request's fields (tools, message names, content parts); if it is well formed, try "
                             "again, and an operator can find the engine's answer in the gateway's log under the "
                             "request id.", "engine_error")

    def _fatal_request(self, model: str, replica) -> ApiError:
        """The error for a request whose engine hung up on it and then failed its health check.

        The engine died while it held this request, and may have died of it (a
        query of death): sent on, the same request took down every replica it
        was retried on, up to `routing.attempts` of them. Not sending it again
        costs a client whose engine died of something else one retry of its own.
        """
        log.warning("replica %s (%s) of %s died while it held a request; the request was not sent to another "
                    "replica, in case it is what killed the engine", replica.spec.id, replica.spec.url, model)
        self.rt.metrics.engine_deaths.labels(model).inc()
        return ApiError(502, f"The engine for {model} stopped while answering this request. It was not sent to "
                             "another replica, in case the request itself made the engine fail; if you retry it "
                             "and this happens again, an operator can find the engine's log under the request id.",
                        "engine_died")

    def _check_health(self, replica) -> None:
        """Ask REPLICA whether it is well, after it failed or timed out a request: a failed check is a strike."""
        if self.rt._get(replica, "/health") is None:
            self._strike(replica, UpstreamError("status", "its health check failed after a failed request"))
