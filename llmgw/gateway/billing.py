"""What a request is billed: its prompt and answer tokens, from the engine's usage where it can be trusted,
else counted on a replica (its tokenizer and chat template), else floored from the text.

The rules (what is trusted, what is floored, per choice) are llmgw/gateway/metering.py; this is the
part that asks a replica: llama.cpp's `/tokenize` and, for a chat's prompt, its template
(llmgw/gateway/promptcount.py), each answered at once or not at all within TOKENIZE_TIMEOUT.
"""

from __future__ import annotations

import json
import time

from llmgw.gateway import apirequest, metering, promptcount
from llmgw.gateway.dialect import encode
from llmgw.gateway.snapshot import ModelSpec
from llmgw.gateway.upstream import UpstreamError
from llmgw.gateway.worker import Runtime

TOKENIZE_TIMEOUT = 10.0  # seconds for an engine to count a request's tokens (llama.cpp: under a millisecond a prompt)


class Billing:
    def __init__(self, runtime: Runtime):
        self.rt = runtime

    def answer_tokens(self, req, model: ModelSpec, replica, data: bytes) -> tuple[int | None, int | None]:
        """(prompt, completion) billed for a whole answer DATA from REPLICA."""
        usage = apirequest.usage_of(data)
        tokens = metering.trusted(req, usage)
        if tokens is not None:
            return tokens
        if req.kind == "embeddings":  # one usage covers every input; the answer is megabytes of numbers
            return self.billed(req, model, replica, usage, 0)
        choices = metering.answer_choices(data)
        settled, rest = metering.settle(choices, usage)
        prompts, answers = metering.to_tokenize(req, choices, rest)
        counted = self._tokens(replica, answers, False) if answers else None
        served = settled + max(metering.answer_floor(rest), counted or 0)
        prompt = metering.counted_prompts(req, self._prompt_tokens(replica, prompts) or 0)
        return self.billed(req, model, replica, usage, served, prompt)

    def billed(self, req, model: ModelSpec, replica, usage: dict | None, served: int,
                prompt: int = 0) -> tuple[int, int | None]:
        """`metering.billed`, with the prompt counted by REPLICA (where there is one) when USAGE does not say it:
        a stream cut before its usage came (the client left, the engine died), an engine that sends none, or
        one whose figure is not a count. Floored from its text alone, a chat's prompt lacked its template: 7
        tokens billed where the whole answer's usage said 44."""
        if replica is not None and metering.count((usage or {}).get("prompt_tokens")) is None:
            prompt = max(prompt, self.counted_prompt(req, model, replica) or 0)
        return metering.billed(req, usage, served, prompt)

    def counted_prompt(self, req, model: ModelSpec, replica) -> int | None:
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
