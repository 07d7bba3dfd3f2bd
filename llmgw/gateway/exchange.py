"""One `/v1` request, from its arrival to its accounting: the object each step of the pipeline hands on.

An exchange holds who asked (the caller, once authenticated), what (the parsed request), for which model,
which replica answered, and whether it holds a place among the model's requests in flight. Whatever way
the request ends (answered, refused, its stream cut, its client gone) it is accounted for once, by
`finish`: the metrics, the settlement with the accountant and the usage row. A second `finish` does
nothing, so a step that ends a request need not know whether another already did.
"""

from __future__ import annotations

import http
import time

from llmgw.gateway import guard
from llmgw.gateway.errors import ApiError

OVERHEAD_HEADER = "X-Llmgw-Overhead-Ms"


def status_line(status: int) -> str:
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Engine Status"


class Exchange:
    __slots__ = ("rt", "t0", "dialect", "caller", "req", "model", "replica", "flying", "finished", "turn",
                 "endpoint", "profile")

    def __init__(self, rt, dialect, t0: float):
        self.rt = rt  # the worker's Runtime
        self.t0 = t0  # perf_counter when the request arrived
        self.dialect = dialect  # the client's API, which its errors are written in
        self.caller = None  # gateway.caller.Caller, once known
        self.req = None  # the parsed request (gateway.apirequest), once read
        self.model = None  # gateway.snapshot.ModelSpec, once resolved
        self.replica: str | None = None  # the id of the replica that answered (or held it when the client left)
        self.flying = False  # counted in the model's requests in flight
        self.finished = False
        self.turn = None  # gateway.threads.Turn: its part in a kept conversation, where it names one
        self.endpoint = "models"  # what its usage row names, where it has no request body (`req.api` where it has)
        self.profile = None  # gateway.routingprofiles.RoutingProfile it is routed by, once sent to a replica

    def overhead_ms(self) -> str:
        """The header value: milliseconds since the request arrived."""
        return f"{(time.perf_counter() - self.t0) * 1000:.2f}"

    def fly(self) -> None:
        """The request is on its way to the model's replicas: counted in flight until `land` or `finish`."""
        self.rt.metrics.in_flight.labels(self.model.name).inc()
        self.flying = True

    def land(self) -> None:
        """Out of flight without having held a place at an engine (no replica took it): nothing is freed."""
        self.rt.metrics.in_flight.labels(self.model.name).dec()
        self.flying = False

    def refuse(self, start_response, e: ApiError) -> list[bytes]:
        """Answer with E, in the caller's API shape."""
        body, headers = self.dialect.error(e)
        headers.append((OVERHEAD_HEADER, self.overhead_ms()))
        if self.caller is not None:
            headers += self.caller.limit_headers()
        start_response(e.status_line, headers)
        return [body]

    def finish(self, status: int, tokens: tuple[int | None, int | None] | None = None,
               ttft: float | None = None) -> None:
        """Account for the request, once: metrics for every request; for every one with a caller, its
        settlement and usage row. TOKENS: (prompt, completion) billed, either None where not known; None
        where nothing was served. TTFT: seconds to the first byte of a stream that sent one."""
        if self.finished:
            return
        self.finished = True
        rt, caller, req, model = self.rt, self.caller, self.req, self.model
        elapsed = time.perf_counter() - self.t0
        m = rt.metrics
        label = model.name if model is not None else "unknown"
        m.requests.labels(label, str(status)).inc()
        m.duration.labels(label).observe(elapsed)
        if self.flying:
            m.in_flight.labels(label).dec()
            rt.queue.release(label)  # a place at an engine is free: a request waiting its turn may take it
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
            rt.limiter.settle(rt.router.snapshot.accountant, caller.reservation, used, cost)
            caller.reservation = None
        rt.usage.record((
            time.time(), caller.key_id, caller.project_id, req.model if req else None, model.name if model else None,
            self.replica, req.api if req else self.endpoint, bool(req and req.stream), status, prompt, completion,
            elapsed * 1000, ttft * 1000 if ttft is not None else None, caller.user_id, cost, *guard.row(req)))
