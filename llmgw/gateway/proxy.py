"""The `/v1` request pipeline's entry: authenticate, read, resolve, then admit and forward, or answer here.

Every OpenAI route goes through this one path; nothing here queries the
database or waits on anything but the client and the engine. It is a plain
WSGI callable rather than a Flask view: on this path Flask's dispatch costs
a few tenths of a millisecond a request, which is most of the budget.

A request is carried by its `Exchange` (llmgw/gateway/exchange.py), one step at a time, each in
its own module: admission (llmgw/gateway/admit.py), then forwarding (llmgw/gateway/forward.py),
which sends it through the attempts on replicas (llmgw/gateway/attempts.py) and relays the answer;
what it is billed is llmgw/gateway/billing.py. However it ends, the exchange accounts for it once.

Guardrails (llmgw/gateway/guard.py) hook in at four places: a judge asked for
resolves to nothing (404, as any unknown name), a prompt is judged after
admission, and an answer (whole, or a stream held until judged) in forwarding.
"""

from __future__ import annotations

import json
import logging
import time

import gevent
from gunicorn.http.errors import ParseException

from llmgw.gateway import apirequest, mcpserver, notes, promptcount, routes, threads
from llmgw.gateway.admit import Admission
from llmgw.gateway.attempts import Attempts, ClientLeft
from llmgw.gateway.billing import Billing
from llmgw.gateway.caller import Caller
from llmgw.gateway.connguard import BodyTimeout
from llmgw.gateway.dialect import OPENAI
from llmgw.gateway.errors import REASONS, ApiError
from llmgw.gateway.exchange import OVERHEAD_HEADER, Exchange
from llmgw.gateway.forward import LOAD_POLL, Forwarder
from llmgw.gateway.guard import Guard
from llmgw.gateway.responses import RESPONSES
from llmgw.gateway.snapshot import ModelSpec
from llmgw.gateway.threads import Threads
from llmgw.gateway.worker import Runtime

log = logging.getLogger("llmgw.proxy")

MODEL_PATH = routes.MODELS + "/"  # `GET /v1/models/ID`
THREADS = threads.PATH  # `DELETE /v1/threads/ID`
STORED = "/v1/responses/"  # `GET` and `DELETE /v1/responses/ID`: a kept response
NOTES = notes.PATH + "/"  # `/v1/memory/ID`
PIN_HEADER = "HTTP_X_LLMGW_REPLICA"  # a replica's id: an administrator's request for that replica alone
PIN_MOST = 200  # characters of it read (a replica id is at most that)


class Proxy:
    def __init__(self, runtime: Runtime):
        self.rt = runtime
        cfg = runtime.cfg
        self.max_body = cfg["gateway.max_body_bytes"]
        # Only the prefix policy reads a conversation's key: under the others none is made.
        self.prefix_bytes = cfg["routing.affinity_prefix_bytes"] if cfg["routing.policy"] == "prefix" else 0
        self.load_wait = cfg["gateway.load_wait"]
        self.chat_max_tokens = cfg["gateway.chat_max_tokens"] or None
        self.guard = Guard(runtime)
        self.billing = Billing(runtime)
        self.admission = Admission(runtime, self.billing)
        self.threads = Threads(runtime, self.prefix_bytes)
        self.notes = notes.Notes(runtime, self.threads.run)
        self.mcp = mcpserver.McpServer(self.notes)
        self.forwarder = Forwarder(runtime, Attempts(runtime, self.billing), self.billing, self.guard, self.threads)

    def __call__(self, environ, start_response, caller: Caller | None = None):
        """Answer one `/v1` request; CALLER is given when someone signed in (the chat page) makes it."""
        t0 = time.perf_counter()
        path = environ.get("PATH_INFO", "")
        raw = None
        kind, dialect = routes.ROUTES.get(path) or (None, OPENAI)
        ex = Exchange(self.rt, dialect, t0)
        ex.caller = caller
        try:
            if kind is None and path != routes.MODELS and not path.startswith((MODEL_PATH, THREADS, STORED, NOTES)) \
                    and path not in (notes.PATH, mcpserver.PATH):
                raise ApiError(404, f"There is no API at {path}. This gateway serves {routes.SERVED}.",
                               "unknown_url")
            if caller is None:
                caller = self.admission.authenticate(dialect.credential(environ))
            ex.caller = caller
            method = environ["REQUEST_METHOD"]
            if kind is None and path.startswith(THREADS):
                return self._delete_thread(ex, environ, path[len(THREADS):], start_response)
            if kind is None and path.startswith(STORED):
                return self._stored_response(ex, environ, path[len(STORED):], start_response)
            if kind is None and (path == notes.PATH or path.startswith(NOTES)):
                return self._notes(ex, environ, path[len(notes.PATH):], start_response)
            if kind is None and path == mcpserver.PATH:
                return self._mcp(ex, environ, start_response)
            if kind is None:
                if method != "GET":
                    raise ApiError(405, f"Use GET for {path}.", "method_not_allowed")
                if path == routes.MODELS:
                    return self._models(ex, start_response)
                return self._model(ex, path[len(MODEL_PATH):], start_response)
            if method != "POST":
                raise ApiError(405, f"Use POST for {path}.", "method_not_allowed")
            raw = self._read_body(environ)
            try:
                req = ex.req = dialect.parse(kind, raw, self.prefix_bytes)
                req.dialect = dialect
                model = ex.model = self._resolve(req.model, caller)
                if model.stopped and not self.rt.router.serves(model.name):  # before any limit or judge
                    raise ApiError(503, f"{model.name} is stopped: an operator scaled it to no replica, and nothing "
                                        f"starts it until one runs it again (`llmgw ctl scale {model.name} --max 1`). "
                                        "Use another model meanwhile; /v1/models lists those served.", "model_stopped")
                # The chat page's own ceiling holds for its requests, whatever a person sends by hand.
                ceiling = (min(filter(None, (model.max_output, self.chat_max_tokens)), default=None)
                           if caller.key_id.startswith("session:") else model.max_output)
                req.bound_output(model.name, ceiling)
                pin = None if kind == "tokens" else self._pinned(environ.get(PIN_HEADER), caller, model)
                # A kept conversation's history, put before the new turn: the prompt admission and the
                # engine see (and count_tokens counts) is the whole of it.
                thread_id = environ.get(threads.HEADER)
                if thread_id is not None:
                    self.threads.join(ex, thread_id)
                elif req.api == RESPONSES.name and kind == "chat":
                    self.threads.join_responses(ex)
            except ApiError:
                # A refused request still counts against the key's rate: requests for a model that does not
                # exist were answered before admission, so no rate limit held them.
                self.admission.count(caller)
                raise
            if kind == "tokens":
                return self._count_tokens(ex, start_response)
            self.admission.admit(caller, req, model)
            self.guard.check_prompt(req, model)
            return self.forwarder.forward(ex, environ, start_response, pin)
        except ApiError as e:
            if ex.req is None and raw is not None and e.status == 400 and e.param is not None:
                ex.model = self._named_model(raw)  # a field of the body was at fault, so it is JSON
            ex.finish(e.status, e.tokens if isinstance(e, ClientLeft) else None)
            return ex.refuse(start_response, e)
        except Exception:
            # A bug must cost one request, never the worker, and the client still gets an error it can parse.
            # It is accounted for like any other request (where a step has not already done so): what it was
            # admitted with is let go, a worker's allowance being handed back only once all its requests settled.
            log.exception("unexpected failure answering %s", path)
            ex.finish(500)
            body, headers = dialect.error(ApiError(500, "The gateway failed to handle this request. It has been "
                                                        "logged; try again.", "internal_error"))
            start_response(REASONS[500], headers)
            return [body]

    def _delete_thread(self, ex: Exchange, environ, thread_id: str, start_response):
        """`DELETE /v1/threads/ID`: a kept conversation deleted now, by a key of its project."""
        if environ["REQUEST_METHOD"] != "DELETE":
            raise ApiError(405, f"Use DELETE for {THREADS}ID.", "method_not_allowed")
        ex.endpoint = "threads"
        self.admission.count(ex.caller)
        deleted = self.threads.delete(ex.caller, thread_id)
        ex.finish(200)
        return self._json(ex, start_response, deleted)

    def _stored_response(self, ex: Exchange, environ, response_id: str, start_response):
        """`GET /v1/responses/ID`, a kept response as it was answered, or `DELETE` it."""
        method = environ["REQUEST_METHOD"]
        if method not in ("GET", "DELETE"):
            raise ApiError(405, f"Use GET or DELETE for {STORED}ID.", "method_not_allowed")
        ex.endpoint = "responses"
        self.admission.count(ex.caller)
        found = self.threads.stored(ex.caller, response_id, delete=method == "DELETE")
        ex.finish(200)
        if isinstance(found, dict):
            return self._json(ex, start_response, found)
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(found))),
                                  (OVERHEAD_HEADER, ex.overhead_ms())])
        return [found]

    def _notes(self, ex: Exchange, environ, rest: str, start_response):
        """`/v1/memory`: a project's notes (llmgw/gateway/notes.py)."""
        method = environ["REQUEST_METHOD"]
        ex.endpoint = "memory"
        body = self._read_body(environ) if method in ("POST", "PATCH", "PUT") else b""
        self.admission.count(ex.caller)
        status, value = self.notes.answer(ex.caller, method, rest, environ.get("QUERY_STRING", ""), body)
        ex.finish(status)
        data = json.dumps(value, ensure_ascii=False).encode()
        start_response(REASONS[status], [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                                         (OVERHEAD_HEADER, ex.overhead_ms())])
        return [data]

    def _mcp(self, ex: Exchange, environ, start_response):
        """`/v1/mcp`: the notes as MCP tools (llmgw/gateway/mcpserver.py). A refusal of the key is a
        JSON-RPC error, which an MCP client shows, under the refusal's HTTP status."""
        if environ["REQUEST_METHOD"] != "POST":
            # The transport's GET opens a stream for the server's own messages, which this one has none of.
            raise ApiError(405, f"Use POST for {mcpserver.PATH}: this MCP server answers each request and sends "
                                "nothing of its own.", "method_not_allowed")
        ex.endpoint = "mcp"
        body = self._read_body(environ)
        try:
            self.admission.count(ex.caller)
            status, data = self.mcp.answer(ex.caller, body)
        except ApiError as e:
            status, data = e.status, self.mcp.refusal(e)
        ex.finish(status)
        headers = [(OVERHEAD_HEADER, ex.overhead_ms())]
        if data is not None:
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        else:
            headers.append(("Content-Length", "0"))
        start_response(REASONS[status], headers)
        return [data or b""]

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
        return [(name, spec) for name, spec in listed if self.admission.may_use(caller, spec.name)]

    def _models(self, ex: Exchange, start_response):
        data = [self._model_object(name, spec) for name, spec in self._listed(ex.caller)]
        return self._json(ex, start_response, {"object": "list", "data": data})

    def _model(self, ex: Exchange, name: str, start_response):
        """`GET /v1/models/NAME`: one entry of the list, an alias its own. A model the key may not use is
        403, as a request for it is: the same question gets the same answer, which says what it may use
        (a 404 would send its holder looking for a typo in a name that exists)."""
        caller = ex.caller
        spec = dict(self.rt.router.snapshot.listed_ids()).get(name)
        if spec is None:
            raise ApiError(404, self._unknown_model(name, caller), "model_not_found", "model")
        if not self.admission.may_use(caller, spec.name):
            raise self.admission.not_allowed(caller, spec.name)
        return self._json(ex, start_response, self._model_object(name, spec))

    def _model_object(self, name: str, spec: ModelSpec) -> dict:
        entry = {"id": name, "object": "model", "created": spec.created, "owned_by": "llmgw", "root": spec.name,
                 "max_context": spec.max_context, "ready": self.rt.router.serves(spec.name)}
        if spec.description:  # absent, not null or "", where nobody wrote one: a client shows what it finds
            entry["description"] = spec.description
        return entry

    @staticmethod
    def _json(ex: Exchange, start_response, value):
        body = json.dumps(value).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                  (OVERHEAD_HEADER, ex.overhead_ms())])
        return [body]

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

    def _count_tokens(self, ex: Exchange, start_response):
        """Answer EX's request, of kind "tokens": how many tokens its prompt is (llmgw/gateway/promptcount.py).

        It generates nothing, so it takes no turn in the admission queue and reserves no tokens; it
        counts against the key's request rate like any request. A replica of the model counts, where
        one is in rotation and its engine can; otherwise the answer is an estimate.
        """
        caller, req, model = ex.caller, ex.req, ex.model
        self.admission.check_allowlist(caller, model)
        self.admission.count(caller)
        replica = self.rt.router.pick(model.name, time.monotonic(), None, set())
        counted = self.billing.counted_prompt(req, model, replica) if replica is not None else None
        if counted is None:
            counted = promptcount.estimate(req.raw)
        body = req.dialect.tokens(req, counted)
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                  (OVERHEAD_HEADER, ex.overhead_ms())] + caller.limit_headers())
        ex.replica = replica.spec.id if replica else None
        ex.finish(200)
        return [body]
