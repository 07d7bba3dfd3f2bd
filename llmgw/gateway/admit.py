"""Admission: who is asking, and whether the pools that limit them let this request in.

A key is checked against the worker's key table (a key made a moment ago waits briefly for the next
table rather than being refused); the model against the key's allowlist; and, where any pool limits the
key, the request is admitted by the accountant with the most it may spend held (the prompt's bound and
the output it may generate), settled later by `Exchange.finish` with what it did spend. When the
accountant does not answer, rate limits are waived and a budget refuses (it could be overspent).
"""

from __future__ import annotations

import logging
import time

import gevent

from llmgw.gateway import metering, promptcount
from llmgw.gateway.billing import Billing
from llmgw.gateway.caller import Caller, duration
from llmgw.gateway.errors import ApiError
from llmgw.gateway.keytable import NOT_YET, Refusal
from llmgw.gateway.limiter import Unavailable
from llmgw.gateway.snapshot import ModelSpec
from llmgw.gateway.worker import Runtime

log = logging.getLogger("llmgw.proxy")  # every step of the request path logs as one, as it did

# Seconds a well-formed key this worker does not hold waits for the next key table before it is refused: the
# controller looks for new keys four times a second, and a worker without one reads the store's revision once
# a second. Only a 401 waits, and only for a secret of the shape llmgw makes.
NEW_KEY_WAIT = 2.0


# Personal use turned off (`llmgw limits set --scope personal --disabled`): a key of no project, or the chat
# page on one's own. 403, not 401: the key is good, and a client told 401 asks for a new one.
def personal_off() -> ApiError:
    return ApiError(403, "Personal use is turned off here: use a key of one of your projects. An operator adds you "
                         "to a project (`llmgw users join`).", "personal_use_off")


class Admission:
    def __init__(self, runtime: Runtime, billing: Billing):
        self.rt = runtime
        self.billing = billing  # counts a prompt on a replica, where a tokens-a-minute refusal may be mistaken
        self.output_estimate = runtime.cfg["limits.output_estimate"]

    def authenticate(self, credential: str | None) -> Caller:
        table = self.rt.keys
        result = table.authenticate(credential, time.time())
        if result is NOT_YET and self.rt.newer_keys(NEW_KEY_WAIT):
            # A key made a moment ago reaches this worker within a second or so (pushed by the controller, or
            # read from the store's revision): it works on its first request, not after a 401.
            table = self.rt.keys
            result = table.authenticate(credential, time.time())
        if isinstance(result, Refusal):
            raise ApiError(401, result.message, result.code)
        caller = Caller(result.id, result.project_id, result.user_id, table.access(result))
        if caller.access.personal_off:
            raise personal_off()
        return caller

    def admit(self, caller: Caller, req, model: ModelSpec) -> None:
        """Hold the request to its allowlist and to every pool that limits it; raises ApiError when refused."""
        self.check_allowlist(caller, model)
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
        prompt = self.billing.counted_prompt(req, model, replica) if replica is not None else None
        if prompt is None or prompt >= bound or prompt + output > room:
            return refusal
        tokens, cost = prompt + output, caller.price.cost(prompt, output)
        try:
            address = self.accountant()
            parts = self.rt.router.snapshot.parts
            if parts:
                # The parts up to the one that refused counted the request in their requests-a-minute pools;
                # those after it were never asked, and count it now.
                at = refusal.get("at", len(parts))
                split = [(part, _rates_left_out(levels) if i <= at else levels)
                         for i, (part, levels) in enumerate(caller.access.parts(len(parts)))]
                answer = self.rt.limiter.admit_split(parts, (), split, priced, tokens, cost, allowances=False)
            else:
                answer = self.rt.limiter.ask(address, {"op": "admit", "levels": _rates_left_out(caller.wire),
                                                       "priced": priced, "tokens": tokens, "cost": cost})
        except Unavailable:
            return refusal
        if "rpm" in said:
            answer["status"] = {**(answer.get("status") or {}), "rpm": said["rpm"]}
        return answer

    def check_allowlist(self, caller: Caller, model: ModelSpec) -> None:
        if caller.access.personal_off:  # the chat page's person on their own; a key never gets this far
            raise personal_off()
        if not self.may_use(caller, model.name):
            self.rt.metrics.limited.labels("model").inc()
            raise self.not_allowed(caller, model.name)

    def may_use(self, caller: Caller, name: str) -> bool:
        """Whether CALLER's allowlist lets it use the served model NAME (an alias on the list allows its model)."""
        models = caller.access.models
        return models is None or self.rt.router.snapshot.allows(models, name)

    @staticmethod
    def not_allowed(caller: Caller, name: str) -> ApiError:
        shown = ", ".join(sorted(caller.access.models)) or "none"
        return ApiError(403, f"This key may not use {name}. It may use: {shown}. Ask an operator if you need "
                             "another model.", "model_not_allowed", "model")

    def count(self, caller: Caller) -> None:
        """Count a request refused before admission against CALLER's rates; raises ApiError(429) past one."""
        if caller.access.levels:
            self._admitted(caller, self._ask(caller, False, 0, 0, None))

    def _ask(self, caller: Caller, priced: bool, estimate: int, cost: int, model: str | None) -> dict | None:
        """The accountant's answer to admitting ESTIMATE tokens and COST for CALLER; None where it did not
        answer and the limits are waived. Raises ApiError where it did not answer and a budget could refuse."""
        try:
            address = self.accountant()
            parts = self.rt.router.snapshot.parts
            if parts:  # the accountant is split (llmgw/control/accountparts.py)
                access = caller.access
                return self.rt.limiter.admit_split(parts, (access.levels, priced), access.parts(len(parts)), priced,
                                                   estimate, cost)
            return self.rt.limiter.admit(address, (caller.access.levels, priced), caller.wire, priced,
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

    def accountant(self) -> str | None:
        """The accountant's address; a worker that follows a controller waits briefly for its first snapshot."""
        address = self.rt.router.snapshot.accountant
        if address is None and self.rt.cfg["gateway.controller"]:
            deadline = time.monotonic() + self.rt.limiter.timeout
            while address is None and time.monotonic() < deadline:
                gevent.sleep(0.02)
                address = self.rt.router.snapshot.accountant
        return address


def _rates_left_out(levels: list[list]) -> list[list]:
    """LEVELS (as the accountant takes them) without their requests-a-minute limits: a request asked again,
    which the first ask counted in them already."""
    return [[counter, None, tpm, budget, period] for counter, _rpm, tpm, budget, period in levels]
