"""Forwarding: an admitted request sent on to its model, answered whole or relayed as a stream.

A request for a model with no replica in rotation waits for one (up to `gateway.load_wait`) where one
will come, a stream with comments every few seconds meanwhile. Until the answer is whole (a stream: until
its head) a client that leaves cancels the request at the engine. Once a stream has started, an engine
that fails ends it with an error event and `[DONE]`: the client has seen tokens, and a second replica
would start the answer again.

Guardrails (llmgw/gateway/guard.py) hook in here twice: a whole answer is judged before the dialect
turns it, and a stream's answer is held in `_relay` until judged.
"""

from __future__ import annotations

import logging
import time

import gevent

from llmgw.gateway import metering
from llmgw.gateway.attempts import Attempts, upstream_error
from llmgw.gateway.billing import Billing
from llmgw.gateway.clientwatch import ClientWatch
from llmgw.gateway.errors import ApiError
from llmgw.gateway.exchange import OVERHEAD_HEADER, Exchange, status_line
from llmgw.gateway.guard import Guard
from llmgw.gateway.snapshot import ModelSpec
from llmgw.gateway.sse import DONE, EventRelay
from llmgw.gateway.threads import Threads
from llmgw.gateway.upstream import Cancel, Response, UpstreamError
from llmgw.gateway.worker import Runtime

log = logging.getLogger("llmgw.proxy")  # every step of the request path logs as one, as it did

SSE_HEADERS = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")]
LOAD_POLL = 0.25  # seconds between looks for a replica of a loading model
KEEPALIVE = 2.0  # seconds between comments on a held stream (the first goes at once)
DEMAND_REMINDER = 5.0  # seconds between reminders to the controller that a model is wanted


class Relay:
    """A stream's answer, as the WSGI server gets it: GEN's pieces, and UNSTARTED() where the server closes
    it before taking the first. A generator closed before it began runs none of its own `finally`, which is
    where a stream gives its replica back and accounts for the request."""

    __slots__ = ("_gen", "_unstarted", "_begun")

    def __init__(self, gen, unstarted):
        self._gen = gen
        self._unstarted = unstarted
        self._begun = False

    def __iter__(self):
        self._begun = True
        return self._gen

    def close(self) -> None:
        self._gen.close()
        if not self._begun:
            self._begun = True
            self._unstarted()


class Forwarder:
    def __init__(self, runtime: Runtime, attempts: Attempts, billing: Billing, guard: Guard, threads: Threads):
        cfg = runtime.cfg
        self.rt = runtime
        self.attempts = attempts
        self.billing = billing
        self.guard = guard
        self.threads = threads
        self.load_wait = cfg["gateway.load_wait"]
        self.placed = bool(cfg["gateway.controller"])  # a controller places (and replaces) replicas

    def forward(self, ex: Exchange, environ, start_response, pin=None):
        """Answer EX's admitted request from a replica of its model; PIN: the replica the request named
        (`Proxy._pinned`), the only one it is sent to."""
        rt = self.rt
        caller, req, model = ex.caller, ex.req, ex.model
        # Behind a controller a model without a replica in rotation gets one soon (it is starting,
        # moving, or being replaced), so the request waits for it; with only configured endpoints
        # nothing would come, and the 503 is immediate.
        if (model.on_demand or self.placed) and not rt.router.serves(model.name):
            if model.on_demand:
                rt.demand(model.name)
            if req.stream:
                # Headers now, then a comment every few seconds: the client sees a live
                # stream rather than a silent socket while the model loads.
                start_response("200 OK", SSE_HEADERS + caller.limit_headers() + _thread_headers(ex))
                ex.fly()
                return Relay(self._held_stream(ex, environ), lambda: ex.finish(499))
            for _ in self._until_ready(model):
                pass
            if not rt.router.serves(model.name):
                raise self._still_loading(model)
        ex.fly()
        # Until the answer is whole (a stream: until its head), a client that leaves cancels the request: the
        # engine stops, as for a stream, rather than generating for nobody until it ends or first_byte passes.
        sock = environ.get("gunicorn.socket")
        cancel = Cancel()
        watch = ClientWatch(sock, cancel) if sock is not None else None
        try:
            resp, replica, data, overhead = self.attempts.connect_in_turn(ex, pin, cancel)
        except ApiError:
            ex.land()
            raise
        finally:
            if watch is not None:
                watch.stop()
        if data is None:
            start_response("200 OK", SSE_HEADERS + [(OVERHEAD_HEADER, f"{overhead:.2f}")] + caller.limit_headers()
                           + _thread_headers(ex))
            return Relay(self._relay(ex, environ, resp, replica),
                         lambda: self._unstarted(ex, resp, replica))
        tokens = self.billing.answer_tokens(req, model, replica, data)
        if resp.status < 300:
            try:
                self.guard.check_answer(req, model, data)
            except ApiError as e:  # withheld: the engine's work is billed, as for any answer it gave
                ex.finish(e.status, tokens)
                return ex.refuse(start_response, e)
        message = self.threads.answer(ex, data) if resp.status < 300 else None
        try:
            data = req.dialect.answer(req, data)
        except ApiError as e:  # an answer the client's API cannot carry: the engine's work is billed all the same
            ex.finish(e.status, tokens)
            return ex.refuse(start_response, e)
        except Exception:  # a bug, which Proxy logs and answers with a 500; the request is accounted for here
            ex.finish(500, tokens)
            raise
        if message is not None:
            self.threads.keep(ex, message, data)
        start_response(status_line(resp.status), [
            ("Content-Type", resp.headers.get("content-type", "application/json")),
            ("Content-Length", str(len(data))), (OVERHEAD_HEADER, f"{overhead:.2f}")] + caller.limit_headers()
            + _thread_headers(ex))
        ex.finish(resp.status, tokens)
        return [data]

    def _unstarted(self, ex: Exchange, resp: Response, replica) -> None:
        """A stream closed before it began (the client gone, the worker stopping): the engine's answer cut,
        the replica's count lowered, and the request billed as a stream cut before its first token."""
        resp.abort()
        replica.outstanding -= 1
        ex.finish(499, self.billing.billed(ex.req, ex.model, replica, None, 0))

    def _held_stream(self, ex: Exchange, environ):
        """The stream of a request for a model that is loading: comments while waiting, then the answer."""
        req, model = ex.req, ex.model
        said = 0.0
        for _ in self._until_ready(model):
            if time.monotonic() - said >= KEEPALIVE:
                yield f": {model.name} is loading\n\n".encode()
                said = time.monotonic()
        try:
            if not self.rt.router.serves(model.name):
                raise self._still_loading(model)
            resp, replica, _, _ = self.attempts.connect_in_turn(ex)
        except ApiError as e:
            ex.finish(e.status)
            yield req.dialect.stream_error(req, e)
            return
        except Exception:  # a bug: the stream is cut, and the request accounted for as a 500
            ex.finish(500)
            raise
        yield from self._relay(ex, environ, resp, replica)

    def _relay(self, ex: Exchange, environ, resp: Response, replica):
        """The generator that streams RESP, REPLICA's answer to EX's request, to the client, accounting for it
        at the end."""
        req, model, t0 = ex.req, ex.model, ex.t0
        relay = EventRelay(req.client_wants_usage)
        held = self.guard.hold(req, model)  # the answer, kept back until judged; None: not judged
        translator = req.dialect.stream(req)
        keeper = self.threads.keeper(ex, translator)  # a kept conversation's answer, kept before its end goes out
        sock = environ.get("gunicorn.socket")
        watcher = ClientWatch(sock, resp) if sock is not None else None
        status, ttft = 200, None
        # Until its first event, comments are no answer (upstream.Response); one may have come with the head.
        resp.awaiting_answer = resp.conn is None or b"data:" not in resp.conn.buf
        try:
            for piece in resp.iter_body(ex.profile.idle):
                out = relay.feed(piece)
                keeper.gather(out)
                if held is not None:
                    if keepalive := held.keep(out):
                        yield keepalive
                    continue
                if out and translator is not None:
                    out = translator.feed(out)
                keeper.keep(relay.done)
                if out:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    yield out
                if translator is not None and translator.failure is not None:
                    # The engine reported a failure mid-stream and the client's answer has ended with it. Read no
                    # more: a client that hangs up on the error would otherwise be counted as leaving (499).
                    break
            tail = relay.rest()
            keeper.gather(tail)
            if held is not None:
                tail = held.release(tail)  # raises ApiError where the judge refuses it, or cannot judge it
            if translator is not None:
                tail = translator.feed(tail) + translator.end()
                if translator.failure is not None:  # the engine reported a failure mid-stream
                    status = translator.failure.status
            keeper.keep(True)
            if tail:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                yield tail
        except ApiError as e:  # a held answer the guard withheld: nothing of it has gone out
            status = e.status
            yield req.dialect.stream_error(req, e)
        except UpstreamError as e:
            if relay.done:
                pass  # the client had the whole answer, [DONE] included; what the engine does after is moot
            elif resp.closed_by_other:
                status = 499
            else:
                status = 504 if e.phase in ("idle", "total") else 502
                self.attempts.blame(replica, e)
                log.warning("stream from replica %s (%s) of %s broke off: %s", replica.spec.id, replica.spec.url,
                            model.name, e)
                error = upstream_error(model.name, e)
                yield translator.fail(error) if translator is not None else error.sse_event() + DONE
        except GeneratorExit:
            if not relay.done:
                status = 499  # the client left while we were writing to it, before the answer was whole
            raise
        finally:
            if watcher is not None:
                watcher.stop()
            self._relayed(ex, resp, replica, relay, status, ttft)

    def _relayed(self, ex: Exchange, resp: Response, replica, relay: EventRelay, status: int, ttft) -> None:
        """The end of a relayed stream: the engine's connection kept or cut, REPLICA's count lowered, and the
        request accounted for with STATUS and what RELAY read of its tokens."""
        req, model = ex.req, ex.model
        if resp.done and status == 200:
            resp.release()
        else:
            resp.abort()
        replica.outstanding -= 1
        tokens = None
        try:
            # A replica that failed the stream may not answer its tokenizer either: another counts the prompt.
            counter = replica if status < 500 else self.rt.router.pick(model.name, time.monotonic(), None,
                                                                       {replica.spec.id})
            tokens = (metering.trusted(req, relay.usage, relay.reports)
                      or self.billing.billed(req, model, counter, relay.usage, relay.deltas))
        finally:
            ex.finish(status, tokens, ttft)

    def _until_ready(self, model: ModelSpec):
        """Yield, every LOAD_POLL seconds, while MODEL has no replica in rotation; at most `gateway.load_wait`.

        For an on-demand model the controller is reminded of the demand every
        few seconds, in case a message was lost or its first try to start the
        model failed; any other model's replicas the controller brings back
        without being asked.
        """
        deadline = time.monotonic() + self.load_wait
        reminded = time.monotonic()
        while not self.rt.router.serves(model.name) and time.monotonic() < deadline:
            if model.on_demand and time.monotonic() - reminded >= DEMAND_REMINDER:
                self.rt.demand(model.name)
                reminded = time.monotonic()
            yield
            gevent.sleep(LOAD_POLL)

    def _still_loading(self, model: ModelSpec) -> ApiError:
        why = "it runs on demand and is not ready" if model.on_demand else "no replica of it is ready"
        return ApiError(503, f"{model.name} is loading: {why} after {self.load_wait:.0f} s. Retry in a minute.",
                        "model_loading", retry_after=60)


def _thread_headers(ex: Exchange) -> list[tuple[str, str]]:
    return ex.turn.headers() if ex.turn is not None else []
