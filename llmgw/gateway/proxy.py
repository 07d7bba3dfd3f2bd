"""The `/v1` request pipeline: authenticate, read, route, forward, relay, account.

Every OpenAI route goes through this one path; nothing here queries the
database or waits on anything but the client and the engine. It is a plain
WSGI callable rather than a Flask view: on this path Flask's dispatch costs
a few tenths of a millisecond a request, which is most of the budget.

Whose fault, and what follows. What says the replica is unwell (no
connection, a connect timeout, silence mid-answer, a connection cut
mid-answer, a 502, 503 or 504: the engine, or something in front of it,
cannot serve now) counts against its breaker and, before anything has reached
the client, is tried again on another replica, up to `routing.attempts`.
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

Once a stream has started, an engine that fails ends it with an error event
and `[DONE]`: the client has seen tokens, and a second replica would start
the answer again.

Guardrails (llmgw/gateway/guard.py) hook in at four places: a judge asked for
resolves to nothing (404, as any unknown name), a prompt is judged after
admission, a whole answer before the dialect turns it, and a stream's answer
is held in `_relay` until judged.
"""

from __future__ import annotations

import http
import json
import logging
import re
import time

import gevent
from gunicorn.http.errors import ParseException

from llmgw.gateway import admission, apirequest, guard, metering, promptcount, routes
from llmgw.gateway.caller import Caller, duration
from llmgw.gateway.clientwatch import ClientWatch
from llmgw.gateway.connguard import BodyTimeout
from llmgw.gateway.dialect import OPENAI, encode
from llmgw.gateway.errors import REASONS, ApiError
from llmgw.gateway.keytable import NOT_YET, Refusal
from llmgw.gateway.limiter import Unavailable
from llmgw.gateway.snapshot import ModelSpec
from llmgw.gateway.sse import DONE, EventRelay
from llmgw.gateway.upstream import Cancel, Response, UpstreamError
from llmgw.gateway.worker import Runtime

log = logging.getLogger("llmgw.proxy")

OVERHEAD_HEADER = "X-Llmgw-Overhead-Ms"
SSE_HEADERS = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")]
LOAD_POLL = 0.25  # seconds between looks for a replica of a loading model
KEEPALIVE = 2.0  # seconds between comments on a held stream (the first goes at once)
DEMAND_REMINDER = 5.0  # seconds between reminders to the controller that a model is wanted
HEALTH_CHECK_EVERY = 2.0  # seconds: engine errors on a replica prompt at most one health check this often
TOKENIZE_TIMEOUT = 10.0  # seconds for an engine to count a request's tokens (llama.cpp: under a millisecond a prompt)
MODEL_PATH = routes.MODELS + "/"  # `GET /v1/models/ID`
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
PIN_HEADER = "HTTP_X_LLMGW_REPLICA"  # a replica's id: an administrator's request for that replica alone
PIN_MOST = 200  # characters of it read (a replica id is at most that)
# Seconds a well-formed key this worker does not hold waits for the next key table before it is refused: the
# controller looks for new keys four times a second, and a worker without one reads the store's revision once
# a second. Only a 401 waits, and only for a secret of the shape llmgw makes.
NEW_KEY_WAIT = 2.0


def _status_line(status: int) -> str:
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Engine Status"


# What a client is told of an engine's failure. The UpstreamError's own text
# names the engine's host and port and may quote its answer; that goes to the
# log, under the request id the client's error ends with.
FAILURES = {
    "first_byte": "it did not start its answer within timeouts.first_byte",
    "idle": "it sent nothing for longer than timeouts.idle",
    "total": "the answer took longer than timeouts.total allows",
    "connect": "it could not be reached",
    "closed": "it closed the connection before the answer was complete",
    "status": "it is unavailable",
    "protocol": "its answer could not be read",
    "abandoned": "its replica was taken out of rotation while the request waited on it",
}


def _upstream_error(model: str, e: UpstreamError) -> ApiError:
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
    """The client closed its connection before its answer came: nothing more is done for it. REPLICA and
    TOKENS: the replica that had it and what is billed for the prompt it read (None where none had it)."""

    def __init__(self, replica: str | None, tokens: tuple[int, int | None] | None):
        super().__init__(499, "The client closed the connection before the answer came.", "client_closed_request")
        self.replica = replica
        self.tokens = tokens


class Proxy:
    def __init__(self, runtime: Runtime):
        self.rt = runtime
        cfg = runtime.cfg
        self.max_body = cfg["gateway.max_body_bytes"]
        # Only the prefix policy reads a conversation's key: under the others none is made.
        self.prefix_bytes = cfg["routing.affinity_prefix_bytes"] if cfg["routing.policy"] == "prefix" else 0
        self.attempts = cfg["routing.attempts"]
        self.first_byte = cfg["timeouts.first_byte"]
        self.idle = cfg["timeouts.idle"]
        self.total = cfg["timeouts.total"]
        self.load_wait = cfg["gateway.load_wait"]
        self.placed = bool(cfg["gateway.controller"])  # a controller places (and replaces) replicas
        self.output_estimate = cfg["limits.output_estimate"]
        self.queue = runtime.queue
        self.guard = guard.Guard(runtime)

    def __call__(self, environ, start_response, caller: Caller | None = None):
        """Answer one `/v1` request; CALLER is given when someone signed in (the chat page) makes it."""
        t0 = time.perf_counter()
        path = environ.get("PATH_INFO", "")
        req = raw = None
        model: ModelSpec | None = None
        kind, dialect = routes.ROUTES.get(path) or (None, OPENAI)
        try:
            if kind is None and path != routes.MODELS and not path.startswith(MODEL_PATH):
                raise ApiError(404, f"There is no API at {path}. This gateway serves {routes.SERVED}.",
                               "unknown_url")
            if caller is None:
                caller = self._authenticate(dialect.credential(environ))
            method = environ["REQUEST_METHOD"]
            if kind is None:
                if method != "GET":
                    raise ApiError(405, f"Use GET for {path}.", "method_not_allowed")
                if path == routes.MODELS:
                    return self._models(caller, start_response, t0)
                return self._model(path[len(MODEL_PATH):], caller, start_response, t0)
            if method != "POST":
                raise ApiError(405, f"Use POST for {path}.", "method_not_allowed")
            raw = self._read_body(environ)
            try:
                req = dialect.parse(kind, raw, self.prefix_bytes)
                req.dialect = dialect
                model = self._resolve(req.model, caller)
                req.bound_output(model.name, model.max_output)
                pin = None if kind == "tokens" else self._pinned(environ.get(PIN_HEADER), caller, model)
            except ApiError:
                # A refused request still counts against the key's rate: requests for a model that does not
                # exist were answered before admission, so no rate limit held them.
                self._count(caller)
                raise
            if kind == "tokens":
                return self._count_tokens(start_response, caller, req, model, t0)
            self._admit(caller, req, model)
            self.guard.check_prompt(req, model)
            return self._forward(environ, start_response, caller, req, model, t0, pin)
        except ApiError as e:
            if req is None and raw is not None and e.status == 400 and e.param is not None:
                model = self._named_model(raw)  # a field of the body was at fault, so it is JSON
            replica, tokens = (e.replica, e.tokens) if isinstance(e, ClientLeft) else (None, None)
            self._account(t0, caller, req, model, replica, e.status, tokens, None)
            return self._refuse(start_response, dialect, caller, e, t0)
        except Exception:
            # A bug must cost one request, never the worker, and the client
            # still gets an error it can parse.
            log.exception("unexpected failure answering %s", path)
            if caller is not None and caller.reservation is not None:
                # What it was admitted with is let go (a worker's allowance is handed back only once all of
                # its requests have settled).
                self.rt.limiter.settle(self.rt.router.snapshot.accountant, caller.reservation, 0, 0)
                caller.reservation = None
            body, headers = dialect.error(ApiError(500, "The gateway failed to handle this request. It has been "
                                                        "logged; try again.", "internal_error"))
            start_response(REASONS[500], headers)
            return [body]

    @staticmethod
    def _refuse(start_response, dialect, caller: Caller | None, e: ApiError, t0):
        """Answer with E, in the caller's API shape."""
        body, headers = dialect.error(e)
        headers.append((OVERHEAD_HEADER, f"{(time.perf_counter() - t0) * 1000:.2f}"))
        if caller is not None:
            headers += caller.limit_headers()
        start_response(e.status_line, headers)
        return [body]

    # --- admission -----------------------------------------------------------------

    def _authenticate(self, credential: str | None) -> Caller:
        table = self.rt.keys
        result = table.authenticate(credential, time.time())
        if result is NOT_YET and self.rt.newer_keys(NEW_KEY_WAIT):
            # A key made a moment ago reaches this worker within a second or so (pushed by the controller, or
            # read from the store's revision): it works on its first request, not after a 401.
            table = self.rt.keys
            result = table.authenticate(credential, time.time())
        if isinstance(result, Refusal):
            raise ApiError(401, result.message, result.code)
        return Caller(result.id, result.project_id, result.user_id, table.access[result.id])

    def _admit(self, caller: Caller, req, model: ModelSpec) -> None:
        """Hold the request to its allowlist and to every pool that limits it; raises ApiError when refused."""
        self._check_allowlist(caller, model)
        access = caller.access
        # Every request is priced (its usage row records the cost), limited or not.
        caller.price = self.rt.keys.prices.of(model.name)
        if not access.levels:
            return
        # The most the prompt can be (llmgw/gateway/promptcount.py) and what the request may generate at most,
        # for every prompt and choice: what requests in flight hold then covers what they can spend, and no
        # more than one request's error escapes a limit. Bytes over four, held before, let a prompt of
        # symbols spend three times what it held.
        prompt = promptcount.bound(req.raw)
        output = req.max_tokens or model.max_output or self.output_estimate
        if req.kind != "embeddings":
            output *= metering.answers(req)
        priced = not caller.price.zero()
        answer = self._ask(caller, priced, prompt + output, caller.price.cost(prompt, output), model.name)
        if answer is not None and not answer.get("ok") and answer.get("limit") == "tpm":
            answer = self._recounted(caller, req, model, priced, prompt, output, answer)
        self._admitted(caller, answer)

    def _recounted(self, caller: Caller, req, model: ModelSpec, priced: bool, bound: int, output: int,
                   refusal: dict) -> dict:
        """REFUSAL, by a tokens-a-minute pool, of a request held at its prompt's BOUND, asked again with the
        prompt counted by a replica, where the count may let it in; else REFUSAL.

        A bound is bytes, four times an English prompt's tokens: a prompt whose bytes pass the limit was let
        in only by a minute with nothing in it, and near the limit requests that fit were refused. Counting
        costs a round trip to a replica (two on llama.cpp) on a request already refused, never on one
        admitted, and none where the prompt's text alone (`metering.prompt_floor`) cannot fit: a client past
        its limit does not get megabytes tokenized for each refusal. The refused admit counted the request
        in every requests-a-minute pool, so the second one leaves them out (and their figures for the
        headers are the first answer's)."""
        said = refusal.get("status") or {}
        room = said.get("tpm", (0, 0))[1]  # what the fullest tokens-a-minute pool has left
        if metering.prompt_floor(req) + output > room:
            return refusal
        replica = self.rt.router.pick(model.name, time.monotonic(), None, set())
        prompt = self._counted_prompt(req, model, replica) if replica is not None else None
        if prompt is None or prompt >= bound or prompt + output > room:
            return refusal
        levels = [[counter, None, tpm, budget, period] for counter, _rpm, tpm, budget, period in caller.wire]
        try:
            answer = self.rt.limiter.ask(self._accountant(), {"op": "admit", "levels": levels, "priced": priced,
                                                              "tokens": prompt + output,
                                                              "cost": caller.price.cost(prompt, output)})
        except Unavailable:
            return refusal
        if "rpm" in said:
            answer["status"] = {**(answer.get("status") or {}), "rpm": said["rpm"]}
        return answer

    def _check_allowlist(self, caller: Caller, model: ModelSpec) -> None:
        if not self._may_use(caller, model.name):
            self.rt.metrics.limited.labels("model").inc()
            raise self._not_allowed(caller, model.name)

    def _may_use(self, caller: Caller, name: str) -> bool:
        """Whether CALLER's allowlist lets it use the served model NAME (an alias on the list allows its model)."""
        models = caller.access.models
        return models is None or self.rt.router.snapshot.allows(models, name)

    @staticmethod
    def _not_allowed(caller: Caller, name: str) -> ApiError:
        shown = ", ".join(sorted(caller.access.models)) or "none"
        return ApiError(403, f"This key may not use {name}. It may use: {shown}. Ask an operator if you need "
                             "another model.", "model_not_allowed", "model")

    def _count(self, caller: Caller) -> None:
        """Count a request refused before admission against CALLER's rates; raises ApiError(429) past one."""
        if caller.access.levels:
            self._admitted(caller, self._ask(caller, False, 0, 0, None))

    def _ask(self, caller: Caller, priced: bool, estimate: int, cost: int, model: str | None) -> dict | None:
        """The accountant's answer to admitting ESTIMATE tokens and COST for CALLER; None where it did not
        answer and the limits are waived. Raises ApiError where it did not answer and a budget could refuse."""
        try:
            return self.rt.limiter.admit(self._accountant(), (caller.access.levels, priced), caller.wire, priced,
                                         estimate, cost)
        except Unavailable:
            if priced and any(lv.budget is not None for lv in caller.access.levels):
                log.warning("refused a request of key %s for %s: a budget limits it and the accountant did not "
                            "answer within limits.accountant_timeout", caller.key_id, model)
                raise ApiError(503, "Limits cannot be checked right now (the accountant does not answer), and a "
                                    "budget applies to this key. Try again shortly.", "limits_unavailable",
                               retry_after=5) from None
            return None

    def _admitted(self, caller: Caller, answer: dict | None) -> None:
        """Take the accountant's ANSWER for CALLER (None: it did not answer, and the limits were waived);
        raises ApiError when it refused."""
        if answer is None:
            return
        caller.status = answer.get("status") or {}
        if not answer.get("ok"):
            limit = answer.get("limit", "rpm")
            self.rt.metrics.limited.labels(limit).inc()
            retry = int(answer.get("retry_after") or 1)
            if limit == "budget":
                raise ApiError(429, f"Budget spent: {answer.get('message')}. It starts again in {duration(retry)}; "
                                    "ask an operator for more.", "budget_exhausted", retry_after=retry)
            raise ApiError(429, f"Rate limit: {answer.get('message')}. Retry after {retry} s.",
                           "rate_limit_exceeded" if limit == "rpm" else "tokens_limit_exceeded", retry_after=retry)
        caller.reservation = answer.get("r")

    def _accountant(self) -> str | None:
        """The accountant's address; a worker that follows a controller waits briefly for its first snapshot."""
        address = self.rt.router.snapshot.accountant
        if address is None and self.rt.cfg["gateway.controller"]:
            deadline = time.monotonic() + self.rt.limiter.timeout
            while address is None and time.monotonic() < deadline:
                gevent.sleep(0.02)
                address = self.rt.router.snapshot.accountant
        return address

    def _read_body(self, environ) -> bytes:
        stream = environ["wsgi.input"]
        length = environ.get("CONTENT_LENGTH")
        try:
            if length:
                try:
                    size = int(length)
                except ValueError:
                    raise ApiError(400, "Content-Length is not a number.", "invalid_request") from None
                if size > self.max_body:
                    raise ApiError(413, f"The body is {size} bytes; this gateway accepts at most {self.max_body} "
                                        "(gateway.max_body_bytes). Send less, or ask an operator to raise the limit.",
                                   "body_too_large")
                data = stream.read(size)
                if len(data) < size:
                    raise ApiError(400, "The body ended before Content-Length bytes arrived.", "invalid_request")
                return data
            # A chunked body has no length up front: read one byte past the limit to know.
            data = stream.read(self.max_body + 1)
        except BodyTimeout as e:
            # Too slow (gateway.body_timeout, gateway.body_min_rate); the worker closes the connection after this.
            raise ApiError(408, e.description, "request_timeout") from None
        except ParseException as e:  # gunicorn's, for a chunked body that breaks its framing
            raise ApiError(400, f"The chunked request body is malformed ({e}).", "invalid_request") from None
        if len(data) > self.max_body:
            raise ApiError(413, f"The body is larger than {self.max_body} bytes (gateway.max_body_bytes).",
                           "body_too_large")
        return data

    def _resolve(self, name: str, caller: Caller) -> ModelSpec:
        """The model NAME stands for. A worker that has not yet had the controller's catalog waits for
        it (up to `gateway.load_wait`): 404 is for names the catalog does not hold, not for names this
        worker has not heard of yet."""
        deadline = time.monotonic() + self.load_wait
        snapshot = self.rt.router.snapshot
        while snapshot.awaiting_catalog and snapshot.resolve(name) is None and time.monotonic() < deadline:
            gevent.sleep(LOAD_POLL)
            snapshot = self.rt.router.snapshot
        model = snapshot.resolve(name)
        if model is not None and model.role != "guard":  # a judge serves the gateway: to clients it does not exist
            return model
        if snapshot.awaiting_catalog:
            raise ApiError(503, f"This gateway has not heard the catalog from its controller in "
                                f"{self.load_wait:.0f} s, so it cannot tell whether {name!r} exists. Retry "
                                "shortly; an operator should check that the controller runs.", "catalog_unknown",
                           retry_after=5)
        raise ApiError(404, self._unknown_model(name, caller), "model_not_found", "model")

    def _named_model(self, raw: bytes) -> ModelSpec | None:
        """The model a body refused for one of its fields names, where the catalog holds it: the refusal is
        counted under it in the metrics (a missing `max_tokens` on Messages was counted as model "unknown").
        Read again only on that refusal; a name the catalog does not hold stays "unknown", so no label is
        ever a client's own words."""
        try:
            name = apirequest.read_object(raw).get("model")
        except ApiError:
            return None
        model = self.rt.router.snapshot.resolve(name) if isinstance(name, str) else None
        return model if model is not None and model.role != "guard" else None

    def _unknown_model(self, name: str, caller: Caller) -> str:
        names = [n for n, _ in self._listed(caller)]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        return (f"The model {name!r} does not exist here. Models: {shown or 'none yet'}. "
                "GET /v1/models lists them.")

    def _listed(self, caller: Caller) -> list[tuple[str, ModelSpec]]:
        """What `GET /v1/models` lists to CALLER: every name a client may ask for that its allowlist allows."""
        listed = self.rt.router.snapshot.listed_ids()
        if caller.access.models is None:
            return listed
        return [(name, spec) for name, spec in listed if self._may_use(caller, spec.name)]

    def _models(self, caller: Caller, start_response, t0):
        data = [self._model_object(name, spec) for name, spec in self._listed(caller)]
        return self._json(start_response, {"object": "list", "data": data}, t0)

    def _model(self, name: str, caller: Caller, start_response, t0):
        """`GET /v1/models/NAME`: one entry of the list, an alias its own. A model the key may not use is
        403, as a request for it is: the same question gets the same answer, which says what it may use
        (a 404 would send its holder looking for a typo in a name that exists)."""
        spec = dict(self.rt.router.snapshot.listed_ids()).get(name)
        if spec is None:
            raise ApiError(404, self._unknown_model(name, caller), "model_not_found", "model")
        if not self._may_use(caller, spec.name):
            raise self._not_allowed(caller, spec.name)
        return self._json(start_response, self._model_object(name, spec), t0)

    def _model_object(self, name: str, spec: ModelSpec) -> dict:
        return {"id": name, "object": "model", "created": spec.created, "owned_by": "llmgw", "root": spec.name,
                "description": spec.description or None, "max_context": spec.max_context,
                "ready": bool(self.rt.router.available(spec.name))}

    @staticmethod
    def _json(start_response, value, t0):
        body = json.dumps(value).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                  (OVERHEAD_HEADER, f"{(time.perf_counter() - t0) * 1000:.2f}")])
        return [body]

    # --- forwarding --------------------------------------------------------------------

    def _pinned(self, wanted: str | None, caller: Caller, model: ModelSpec):
        """The replica a request names in `X-Llmgw-Replica` (None when it names none); raises ApiError.

        `llmgw ctl bench` measures one replica at a time through the gateway, so a request may name its
        replica. Only an administrator's key may: such a request passes the balancer and the replica's
        limit of requests in flight (the bench must be able to go past a limit measured before), so a
        client that could name one would load a replica that everyone else's requests are held back from.
        It is not tried elsewhere: a measurement of one replica must not be answered by another.
        """
        if wanted is None:
            return None
        if caller.user_id is None or caller.user_id not in self.rt.keys.admins:
            raise ApiError(403, "Only an administrator's key may choose a replica (X-Llmgw-Replica), as `llmgw ctl "
                                "bench` does. Leave the header out, or use a key of an active administrator "
                                "(`llmgw keys create NAME --for EMAIL`).", "replica_choice_not_allowed")
        replica = self.rt.router.replica_for(model.name, wanted[:PIN_MOST])
        if replica is None:
            raise ApiError(404, f"This gateway has no replica {wanted[:PIN_MOST]!r} of {model.name}. `llmgw ctl "
                                f"replicas --model {model.name}` lists the ready ones; a gateway that does not "
                                "follow their controller does not know them.", "replica_not_found")
        if replica.breaker.is_open:
            raise ApiError(503, f"Replica {replica.spec.id} of {model.name} is out of rotation: it failed recently "
                                "and waits to be probed. Try again in a few seconds.", "replica_out_of_rotation",
                           retry_after=max(1, int(self.rt.cfg["breaker.cooldown"])))
        return replica

    def _forward(self, environ, start_response, caller, req, model, t0, pin=None):
        """PIN: the replica the request named (`_pinned`), the only one it is sent to."""
        rt = self.rt
        # Behind a controller a model without a replica in rotation gets one soon (it is starting,
        # moving, or being replaced), so the request waits for it; with only configured endpoints
        # nothing would come, and the 503 is immediate.
        if (model.on_demand or self.placed) and not rt.router.available(model.name):
            if model.on_demand:
                rt.demand(model.name)
            if req.stream:
                # Headers now, then a comment every few seconds: the client sees a live
                # stream rather than a silent socket while the model loads.
                start_response("200 OK", SSE_HEADERS + caller.limit_headers())
                rt.metrics.in_flight.labels(model.name).inc()
                return self._held_stream(environ, caller, req, model, t0)
            for _ in self._until_ready(model):
                pass
            if not rt.router.available(model.name):
                raise self._still_loading(model)
        rt.metrics.in_flight.labels(model.name).inc()
        # Until the answer is whole (a stream: until its head), a client that leaves cancels the request: the
        # engine stops, as for a stream, rather than generating for nobody until it ends or first_byte passes.
        sock = environ.get("gunicorn.socket")
        cancel = Cancel()
        watch = ClientWatch(sock, cancel) if sock is not None else None
        try:
            resp, replica, data, overhead = self._connect_in_turn(req, model, t0, caller, pin, cancel)
        except ApiError:
            rt.metrics.in_flight.labels(model.name).dec()
            raise
        finally:
            if watch is not None:
                watch.stop()
        if data is None:
            start_response("200 OK", SSE_HEADERS + [(OVERHEAD_HEADER, f"{overhead:.2f}")] + caller.limit_headers())
            return self._relay(environ, resp, replica, caller, req, model, t0)
        tokens = self._answer_tokens(req, model, replica, data)
        if resp.status < 300:
            try:
                self.guard.check_answer(req, model, data)
            except ApiError as e:  # withheld: the engine's work is billed, as for any answer it gave
                self._account(t0, caller, req, model, replica.spec.id, e.status, tokens, None, in_flight=True)
                return self._refuse(start_response, req.dialect, caller, e, t0)
        try:
            data = req.dialect.answer(req, data)
        except ApiError as e:  # an answer the client's API cannot carry: the engine's work is billed all the same
            self._account(t0, caller, req, model, replica.spec.id, e.status, tokens, None, in_flight=True)
            return self._refuse(start_response, req.dialect, caller, e, t0)
        except Exception:  # a bug, which __call__ logs and answers with a 500; the request is accounted for here
            self._account(t0, caller, req, model, replica.spec.id, 500, tokens, None, in_flight=True)
            raise
        start_response(_status_line(resp.status), [
            ("Content-Type", resp.headers.get("content-type", "application/json")),
            ("Content-Length", str(len(data))), (OVERHEAD_HEADER, f"{overhead:.2f}")] + caller.limit_headers())
        self._account(t0, caller, req, model, replica.spec.id, resp.status, tokens, None, in_flight=True)
        return [data]

    def _connect_in_turn(self, req, model, t0, caller, pin=None, cancel: Cancel | None = None):
        """`_connect`, but a request for a saturated model waits its turn in the admission queue
        rather than being refused at once (see llmgw/gateway/admission.py). A request that names its replica
        (PIN) waits for nothing: it is a measurement of that replica, answered or refused by it. CANCEL: as
        for `_connect`; a request whose client left while it waited its turn goes no further."""
        if pin is not None:
            return self._connect(req, model, t0, pin, cancel)
        deadline = time.monotonic() + self.queue.wait
        band = caller.access.band
        router = self.rt.router
        while True:
            if router.limited(model.name):
                self._turn(model, band, lambda: router.has_room(model.name, time.monotonic()))
            if cancel is not None and cancel.cancelled:
                raise ClientLeft(None, None)
            try:
                return self._connect(req, model, t0, None, cancel)
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

    def _connect(self, req, model, t0, pin=None, cancel: Cancel | None = None):
        """Try replicas until one answers: (response, replica, whole body or None for a stream, overhead ms);
        only PIN, once, when the request named it. CANCEL (upstream.Cancel), aborted when the client leaves,
        ends the attempt; the request then goes to no other replica (ClientLeft).

        Raises ApiError when every attempt failed or no replica is in rotation.
        """
        rt = self.rt
        router = rt.router
        path = apirequest.PATHS[req.kind]
        body = req.upstream_body(model.name)
        deadline = time.monotonic() + self.total
        tried: set[str] = set()
        failure: UpstreamError | None = None
        engine_time = 0.0
        for _ in range(self.attempts if pin is None else 1):
            replica = pin or router.pick(model.name, time.monotonic(), req.affinity, tried, req.follows)
            if replica is None:
                break
            if failure is not None:
                rt.metrics.retries.labels(failure.phase).inc()
            tried.add(replica.spec.id)
            replica.outstanding += 1
            sent = time.perf_counter()
            if cancel is not None:
                cancel.abandoned = False
                replica.unanswered.add(cancel)
            try:
                resp = rt.pool.request(replica.target, "POST", path, body, self.first_byte, deadline, cancel=cancel)
                if resp.status == 429:
                    # The engine is full, not broken: another replica may
                    # have room, and the breaker is left alone.
                    resp.read(self.idle)
                    resp.release()
                    raise UpstreamError("busy", "it is at capacity (429)",
                                        retry_after=_retry_after(resp.headers.get("retry-after")))
                if resp.status in UNAVAILABLE:
                    detail = resp.read(self.idle)[:200].decode("utf-8", "replace")
                    resp.release()
                    raise UpstreamError("status", f"it answered {resp.status} {detail}".strip())
                # A whole answer is read here, inside the attempt: if the
                # engine fails halfway, nothing has reached the client yet and
                # another replica can still be tried.
                data = None if req.stream and resp.status < 400 else resp.read(self.idle)
                if cancel is not None:
                    cancel.conn = None  # the answer is in (or the stream's own watch takes over): nothing to abort
            except UpstreamError as e:
                engine_time += time.perf_counter() - sent
                replica.outstanding -= 1
                if cancel is not None and cancel.cancelled:
                    # The engine read the prompt, maybe more: billed as a stream cut before its first token.
                    raise ClientLeft(replica.spec.id, self._billed(req, model, replica, None, 0)) from None
                if cancel is not None and cancel.abandoned:
                    # The replica left rotation while this waited on it: nothing reached the client, and
                    # the replica is already out, so the request goes to another one, with no strike.
                    log.warning("a request on replica %s (%s) for %s was moved: the replica left rotation while "
                                "it waited for an answer", replica.spec.id, replica.spec.url, model.name)
                    failure = UpstreamError("abandoned", "the replica left rotation while the engine had the request")
                    continue
                # A full engine is routine under load (and queued for, below); a failure is worth a line.
                log.log(logging.DEBUG if e.phase == "busy" else logging.WARNING,
                        "an attempt on replica %s (%s) for %s failed: %s", replica.spec.id, replica.spec.url,
                        model.name, e)
                failure = e
                if e.phase == "busy":
                    continue
                self._blame(replica, e)
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
                replica.outstanding -= 1
                raise self._engine_refusal(model, replica, resp.status, data)
            replica.breaker.success()
            overhead = (time.perf_counter() - t0 - engine_time) * 1000
            rt.metrics.overhead.observe(overhead / 1000)
            if data is not None:
                resp.release()
                replica.outstanding -= 1
            rt.used(model.name)
            return resp, replica, data, overhead
        if failure is None:
            configured = len(router.snapshot.replicas_for(model.name))
            if configured:
                raise ApiError(503, f"No replica of {model.name} is in rotation: all {configured} failed recently "
                                    "and are waiting to be probed. Try again in a few seconds.",
                               "no_replica_ready", retry_after=max(1, int(rt.cfg["breaker.cooldown"])))
            raise ApiError(503, f"{model.name} has no replica running. Try again shortly; an operator can check "
                                "that its engines are up.", "no_replica_ready", retry_after=5)
        raise _upstream_error(model.name, failure)

    def _blame(self, replica, e: UpstreamError) -> None:
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

    # --- metering (see llmgw/gateway/metering.py) ---------------------------------------

    def _answer_tokens(self, req, model: ModelSpec, replica, data: bytes) -> tuple[int | None, int | None]:
        """(prompt, completion) billed for a whole answer DATA from REPLICA."""
        usage = apirequest.usage_of(data)
        tokens = metering.trusted(req, usage)
        if tokens is not None:
            return tokens
        if req.kind == "embeddings":  # one usage covers every input; the answer is megabytes of numbers
            return self._billed(req, model, replica, usage, 0)
        choices = metering.answer_choices(data)
        settled, rest = metering.settle(choices, usage)
        prompts, answers = metering.to_tokenize(req, choices, rest)
        counted = self._tokens(replica, answers, False) if answers else None
        served = settled + max(metering.answer_floor(rest), counted or 0)
        prompt = metering.counted_prompts(req, self._prompt_tokens(replica, prompts) or 0)
        return self._billed(req, model, replica, usage, served, prompt)

    def _billed(self, req, model: ModelSpec, replica, usage: dict | None, served: int,
                prompt: int = 0) -> tuple[int, int | None]:
        """`metering.billed`, with the prompt counted by REPLICA (where there is one) when USAGE does not say it:
        a stream cut before its usage came (the client left, the engine died), an engine that sends none, or
        one whose figure is not a count. Floored from its text alone, a chat's prompt lacked its template: 7
        tokens billed where the whole answer's usage said 44."""
        if replica is not None and metering.count((usage or {}).get("prompt_tokens")) is None:
            prompt = max(prompt, self._counted_prompt(req, model, replica) or 0)
        return metering.billed(req, usage, served, prompt)

    def _counted_prompt(self, req, model: ModelSpec, replica) -> int | None:
        """REQ's prompt tokens, template included, as REPLICA of MODEL counts them; None where it cannot
        (llmgw/gateway/promptcount.py)."""
        if req.kind in ("completions", "embeddings"):
            counted = self._prompt_tokens(replica, metering.text_prompts(req))
            return counted + metering.id_prompts(req) if counted is not None else None
        return promptcount.count(lambda path, value: self._engine_json(replica, path, value), req.body, model.name)

    def _prompt_tokens(self, replica, prompts: list[str]) -> int | None:
        """Tokens in PROMPTS as REPLICA processes them, each with its special tokens (a BOS); None when it
        cannot say. The tokenizer adds those to the first item of a list only, so they are asked apart."""
        if not prompts:
            return 0
        text = self._tokens(replica, prompts, False)
        special = self._tokens(replica, "", True)
        return text + special * len(prompts) if text is not None and special is not None else None

    def _tokens(self, replica, content, add_special: bool) -> int | None:
        """How many tokens REPLICA's tokenizer makes of CONTENT, a text or a list of them counted one after
        another (llama.cpp's `POST /tokenize`); None when it cannot say (an engine without one)."""
        answer = self._engine_json(replica, "/tokenize", {"content": content, "add_special": add_special})
        tokens = answer.get("tokens") if answer is not None else None
        return len(tokens) if isinstance(tokens, list) else None

    def _engine_json(self, replica, path: str, value: dict) -> dict | None:
        """REPLICA's answer to VALUE posted to PATH, a helper route (tokenizer, template) answered at once;
        None unless it is a 200 with a JSON object."""
        body = encode(value)  # a prompt's lone surrogates as the escapes they came in
        try:
            resp = self.rt.pool.request(replica.target, "POST", path, body, TOKENIZE_TIMEOUT,
                                        time.monotonic() + TOKENIZE_TIMEOUT)
        except UpstreamError:
            return None
        try:
            data = resp.read(TOKENIZE_TIMEOUT)
        except UpstreamError:
            resp.abort()
            return None
        resp.release()
        try:
            answer = json.loads(data) if resp.status == 200 else None
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None

    def _count_tokens(self, start_response, caller, req, model, t0):
        """Answer REQ, of kind "tokens": how many tokens its prompt is (llmgw/gateway/promptcount.py).

        It generates nothing, so it takes no turn in the admission queue and reserves no tokens; it
        counts against the key's request rate like any request. A replica of the model counts, where
        one is in rotation and its engine can; otherwise the answer is an estimate.
        """
        self._check_allowlist(caller, model)
        self._count(caller)
        replica = self.rt.router.pick(model.name, time.monotonic(), None, set())
        counted = self._counted_prompt(req, model, replica) if replica is not None else None
        if counted is None:
            counted = promptcount.estimate(req.raw)
        body = req.dialect.tokens(req, counted)
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                  (OVERHEAD_HEADER, f"{(time.perf_counter() - t0) * 1000:.2f}")]
                       + caller.limit_headers())
        self._account(t0, caller, req, model, replica.spec.id if replica else None, 200, None, None)
        return [body]

    def _until_ready(self, model: ModelSpec):
        """Yield, every LOAD_POLL seconds, while MODEL has no replica in rotation; at most `gateway.load_wait`.

        For an on-demand model the controller is reminded of the demand every
        few seconds, in case a message was lost or its first try to start the
        model failed; any other model's replicas the controller brings back
        without being asked.
        """
        deadline = time.monotonic() + self.load_wait
        reminded = time.monotonic()
        while not self.rt.router.available(model.name) and time.monotonic() < deadline:
            if model.on_demand and time.monotonic() - reminded >= DEMAND_REMINDER:
                self.rt.demand(model.name)
                reminded = time.monotonic()
            yield
            gevent.sleep(LOAD_POLL)

    def _still_loading(self, model: ModelSpec) -> ApiError:
        why = "it runs on demand and is not ready" if model.on_demand else "no replica of it is ready"
        return ApiError(503, f"{model.name} is loading: {why} after {self.load_wait:.0f} s. Retry in a minute.",
                        "model_loading", retry_after=60)

    def _held_stream(self, environ, caller, req, model, t0):
        """The stream of a request for a model that is loading: comments while waiting, then the answer."""
        said = 0.0
        for _ in self._until_ready(model):
            if time.monotonic() - said >= KEEPALIVE:
                yield f": {model.name} is loading\n\n".encode()
                said = time.monotonic()
        try:
            if not self.rt.router.available(model.name):
                raise self._still_loading(model)
            resp, replica, _, _ = self._connect_in_turn(req, model, t0, caller)
        except ApiError as e:
            self._account(t0, caller, req, model, None, e.status, None, None, in_flight=True)
            yield req.dialect.stream_error(req, e)
            return
        yield from self._relay(environ, resp, replica, caller, req, model, t0)

    def _relay(self, environ, resp: Response, replica, caller, req, model, t0):
        """The generator that streams RESP to the client, accounting for it at the end."""
        relay = EventRelay(req.client_wants_usage)
        held = self.guard.hold(req, model)  # the answer, kept back until judged; None: not judged
        translator = req.dialect.stream(req)
        sock = environ.get("gunicorn.socket")
        watcher = ClientWatch(sock, resp) if sock is not None else None
        status, ttft = 200, None
        try:
            for piece in resp.iter_body(self.idle):
                out = relay.feed(piece)
                if held is not None:
                    if keepalive := held.keep(out):
                        yield keepalive
                    continue
                if out and translator is not None:
                    out = translator.feed(out)
                if out:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    yield out
            tail = relay.rest()
            if held is not None:
                tail = held.release(tail)  # raises ApiError where the judge refuses it, or cannot judge it
            if translator is not None:
                tail = translator.feed(tail) + translator.end()
                if translator.failure is not None:  # the engine reported a failure mid-stream
                    status = translator.failure.status
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
                self._blame(replica, e)
                log.warning("stream from replica %s (%s) of %s broke off: %s", replica.spec.id, replica.spec.url,
                            model.name, e)
                error = _upstream_error(model.name, e)
                yield translator.fail(error) if translator is not None else error.sse_event() + DONE
        except GeneratorExit:
            if not relay.done:
                status = 499  # the client left while we were writing to it, before the answer was whole
            raise
        finally:
            if watcher is not None:
                watcher.stop()
            if resp.done and status == 200:
                resp.release()
            else:
                resp.abort()
            replica.outstanding -= 1
            # A replica that failed the stream may not answer its tokenizer either: another counts the prompt.
            counter = replica if status < 500 else self.rt.router.pick(model.name, time.monotonic(), None,
                                                                       {replica.spec.id})
            tokens = (metering.trusted(req, relay.usage, relay.reports)
                      or self._billed(req, model, counter, relay.usage, relay.deltas))
            self._account(t0, caller, req, model, replica.spec.id, status, tokens, ttft, in_flight=True)

    # --- accounting ----------------------------------------------------------------------

    def _account(self, t0, caller, req, model, replica, status, tokens, ttft, in_flight=False):
        """Metrics for every request; for every one with a caller, its settlement and usage row.

        TOKENS: (prompt, completion) billed, either None where not known; None where nothing was served.
        """
        elapsed = time.perf_counter() - t0
        m = self.rt.metrics
        label = model.name if model is not None else "unknown"
        m.requests.labels(label, str(status)).inc()
        m.duration.labels(label).observe(elapsed)
        if in_flight:
            m.in_flight.labels(label).dec()
            self.queue.release(label)
        if ttft is not None:
            m.ttft.labels(label).observe(ttft)
        prompt, completion = tokens or (None, None)
        if prompt is not None:
            m.tokens.labels(label, "in").inc(prompt)
        if completion is not None:
            m.tokens.labels(label, "out").inc(completion)
        if caller is None:
            return
        cost = caller.price.cost(prompt or 0, completion or 0) if caller.price is not None else 0
        if caller.reservation is not None:
            # What was billed: a request no engine answered settles at nothing.
            used = (prompt or 0) + (completion or 0)
            self.rt.limiter.settle(self.rt.router.snapshot.accountant, caller.reservation, used, cost)
            caller.reservation = None
        self.rt.usage.record((
            time.time(), caller.key_id, caller.project_id, req.model if req else None, model.name if model else None,
            replica, req.api if req else "models", bool(req and req.stream), status, prompt, completion,
            elapsed * 1000, ttft * 1000 if ttft is not None else None, caller.user_id, cost, *guard.row(req)))

