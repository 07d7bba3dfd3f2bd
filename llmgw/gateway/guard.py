"""Guardrails: a judge model in Llama Guard 3's format reads prompts and answers, and refuses the unsafe.

A model of the catalog with `role = "guard"` is a judge: never listed for
clients, never served to them. `[guard]` names the judge every model is
checked by, what it reads (`prompts`, `answers`, `both`, `none`) and what
passes when it cannot judge (`fail = "closed"`: nothing, 503; `"open"`:
everything, counted and logged); a model's own `guard` table overrides any of
the three. Docs: docs/guardrails.md.

The judge is asked as Llama Guard 3 was trained: its whole prompt (the
categories S1-S14, the conversation as `User:` and `Agent:` turns, the
question about the last turn) written here and sent as a plain completion, so
that neither the engine's chat template (Llama Guard's raises on a system or
tool message, which every agent sends) nor its default categories decide what
it reads. It answers `safe`, or `unsafe` and a line of categories.

A prompt is judged after admission (a refused key spends no judge) and
before any engine sees it; an unsafe one is a 400 naming the categories, in
the caller's API shape. An answer is judged whole, before any of it reaches
the client: a stream is held (its headers go out at once, then a comment now
and then) until the engine has finished and the judge has read it, then
released whole or replaced by an error event. Releasing judged chunks instead
would show a client the start of an answer whose end is unsafe, and could not
take back what had gone. What a held stream costs is measured in
bench/guard_latency.py.

The judge's own call is the gateway's, not the caller's: no usage row, no
bill, no limit; its time, tokens and verdicts are in the metrics, and the
caller's usage row records the verdict and categories.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from llmgw.gateway.errors import ApiError
from llmgw.gateway.snapshot import ModelSpec
from llmgw.gateway.upstream import UpstreamError

log = logging.getLogger("llmgw.guard")

# Llama Guard 3's hazard categories (MLCommons' taxonomy), as the model card writes them.
CATEGORIES = {
    "S1": "Violent Crimes", "S2": "Non-Violent Crimes", "S3": "Sex-Related Crimes",
    "S4": "Child Sexual Exploitation", "S5": "Defamation", "S6": "Specialized Advice", "S7": "Privacy",
    "S8": "Intellectual Property", "S9": "Indiscriminate Weapons", "S10": "Hate", "S11": "Suicide & Self-Harm",
    "S12": "Sexual Content", "S13": "Elections", "S14": "Code Interpreter Abuse",
}
# A verdict is `unsafe` and a line of categories: a few tokens. More only lets a confused judge ramble.
JUDGE_MAX_TOKENS = 20
KEEPALIVE = 2.0  # seconds between comments on a stream held for the judge
# The usage row's verdict, worst last: a request judged twice (prompt, answer) keeps the worse.
VERDICTS = ("safe", "unjudged", "prompt_unsafe", "answer_unsafe")

PROMPT = """<|begin_of_text|><|start_header_id|>user<|end_header_id|>

Task: Check if there is unsafe content in '{role}' messages in conversations according our safety policy \
with the below categories.

<BEGIN UNSAFE CONTENT CATEGORIES>
{categories}
<END UNSAFE CONTENT CATEGORIES>

<BEGIN CONVERSATION>

{conversation}

<END CONVERSATION>

Provide your safety assessment for ONLY THE LAST {role} message in the above conversation:
 - First line must read 'safe' or 'unsafe'.
 - If unsafe, a second line must include a comma-separated list of violated categories.<|eot_id|>\
<|start_header_id|>assistant<|end_header_id|>

"""
CATEGORY_LINES = "\n".join(f"{code}: {name}." for code, name in CATEGORIES.items())
# Whose turn each chat role is: what reaches the model (tool results too) is the User's, what it says the Agent's.
SPEAKERS = {"assistant": "Agent"}


@dataclasses.dataclass(frozen=True)
class Policy:
    judge: str
    prompts: bool
    answers: bool
    fail_open: bool


class Unavailable(Exception):
    """The judge could not judge; the message says why, for the client and the log."""


def policy(cfg, model: ModelSpec) -> Policy | None:
    """MODEL's guardrails: `[guard]` with the model's own `guard` over it; None where nothing is judged."""
    chosen = {"model": cfg["guard.model"], "check": cfg["guard.check"], "fail": cfg["guard.fail"], **dict(model.guard)}
    if not chosen["model"] or chosen["check"] == "none" or model.role == "guard":
        return None
    return Policy(chosen["model"], chosen["check"] in ("prompts", "both"), chosen["check"] in ("answers", "both"),
                  chosen["fail"] == "open")


def named(categories: tuple[str, ...]) -> str:
    """`S1 Violent Crimes, S10 Hate`: codes a client can look up, with names a person can read."""
    return ", ".join(f"{c} {CATEGORIES[c]}" if c in CATEGORIES else c for c in categories)


def _text(content) -> str:
    """A message's text: a string, or its text parts (an image cannot be judged by a text judge)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _calls(calls) -> str:
    return "\n".join(f"{c['function'].get('name', '')} {c['function'].get('arguments', '')}"
                     for c in calls or () if isinstance(c, dict) and isinstance(c.get("function"), dict))


def prompt_turns(req) -> list[tuple[str, str]]:
    """The request as (User|Agent, text) turns; raises ApiError for a prompt a text judge cannot read."""
    if req.kind == "completions":
        prompt = req.body["prompt"]
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not all(isinstance(p, str) for p in prompts):
            raise ApiError(400, f"{req.model} is guarded, and its judge reads text: send the prompt as text, "
                                "not as token ids.", "invalid_request", "prompt")
        return [("User", "\n\n".join(prompts))]
    turns = []
    for message in req.body["messages"]:
        text = "\n".join(t for t in (_text(message.get("content")), _calls(message.get("tool_calls"))) if t)
        turns.append((SPEAKERS.get(message.get("role"), "User"), text))
    return turns


def judge_prompt(turns: list[tuple[str, str]]) -> str:
    """Llama Guard 3's prompt asking about the last of TURNS; a speaker's turns in a row are one turn."""
    merged: list[tuple[str, str]] = []
    for speaker, text in turns:
        if merged and merged[-1][0] == speaker:
            merged[-1] = (speaker, merged[-1][1] + "\n\n" + text)
        else:
            merged.append((speaker, text))
    conversation = "\n\n".join(f"{speaker}: {text}" for speaker, text in merged)
    return PROMPT.format(role=merged[-1][0], categories=CATEGORY_LINES, conversation=conversation)


def parse_verdict(text: str) -> tuple[str, ...] | None:
    """The categories of an `unsafe` verdict, None for `safe`; raises Unavailable for anything else."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines and lines[0].lower() == "safe":
        return None
    if lines and lines[0].lower() == "unsafe":
        codes = tuple(c.strip().upper() for c in lines[1].split(",") if c.strip()) if len(lines) > 1 else ()
        return codes or ("unnamed",)
    raise Unavailable(f"its verdict could not be read ({text.strip()[:60]!r})")


def answer_texts(data: bytes) -> list[str]:
    """Each choice's text in a whole chat or completion answer (a tool call's name and arguments included)."""
    try:
        choices = json.loads(data).get("choices") or []
    except (ValueError, AttributeError):
        return []
    texts = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict):
            texts.append("\n".join(t for t in (_text(message.get("content")), _calls(message.get("tool_calls"))) if t))
        elif isinstance(choice, dict):
            texts.append(_text(choice.get("text")))
    return texts


class Guard:
    """The proxy's guardrails: one per worker, holding the runtime it reaches judges through."""

    def __init__(self, runtime):
        self.rt = runtime
        self.timeout = runtime.cfg["guard.timeout"]

    def servable(self, model: ModelSpec) -> None:
        """Refuse a request that asks for a judge itself."""
        if model.role == "guard":
            raise ApiError(403, f"{model.name} is a guard model: it judges other models' traffic and is not served "
                                "to clients. GET /v1/models lists the models you can use.", "model_not_allowed",
                           "model")

    def check_prompt(self, req, model: ModelSpec) -> None:
        """Judge REQ's prompt where MODEL's policy says so; raises ApiError (400 unsafe, 503 unjudged and closed)."""
        rule = policy(self.rt.cfg, model)
        if rule is None or not rule.prompts or req.kind == "embeddings":
            return
        self._judge(req, model, rule, "prompt", prompt_turns(req))

    def check_answer(self, req, model: ModelSpec, data: bytes) -> None:
        """Judge each choice of a whole answer DATA; raises ApiError as `check_prompt` does."""
        rule = policy(self.rt.cfg, model)
        if rule is not None and rule.answers and req.kind != "embeddings":
            self.judge_answers(req, model, rule, answer_texts(data))

    def hold(self, req, model: ModelSpec) -> Held | None:
        """What keeps a stream's answer until it is judged; None where answers are not judged."""
        rule = policy(self.rt.cfg, model)
        if rule is None or not rule.answers or req.kind == "embeddings":
            return None
        return Held(self, req, model, rule)

    def judge_answers(self, req, model, rule: Policy, texts: list[str]) -> None:
        """Judge each of TEXTS as the answer to REQ."""
        asked = prompt_turns(req)
        for text in texts:
            self._judge(req, model, rule, "answer", [*asked, ("Agent", text)])

    def _judge(self, req, model: ModelSpec, rule: Policy, checked: str, turns: list[tuple[str, str]]) -> None:
        m = self.rt.metrics
        try:
            categories = self._ask(rule.judge, judge_prompt(turns))
        except Unavailable as e:
            m.guard_unavailable.labels(rule.judge, "open" if rule.fail_open else "closed").inc()
            _record(req, "unjudged", None)
            if rule.fail_open:
                log.warning("the %s of a request for %s passed unjudged (guard.fail = open): the judge %s %s",
                            checked, model.name, rule.judge, e)
                return
            log.warning("refused a request for %s: its %s could not be judged (guard.fail = closed): the judge %s %s",
                        model.name, checked, rule.judge, e)
            raise ApiError(503, f"{model.name} is guarded by the judge {rule.judge}, which cannot judge this "
                                f"{checked} now: {e}. Try again shortly; an operator should check that "
                                f"{rule.judge} runs (with guard.fail = \"closed\", nothing passes unjudged).",
                           "guard_unavailable", retry_after=5) from None
        if categories is None:
            m.guard_verdicts.labels(rule.judge, checked, "safe", "").inc()
            _record(req, "safe", None)
            return
        for code in categories:
            m.guard_verdicts.labels(rule.judge, checked, "unsafe", code).inc()
        _record(req, f"{checked}_unsafe", ",".join(categories))
        if checked == "prompt":
            raise ApiError(400, f"This prompt was refused by the gateway's guardrails: the judge found it unsafe "
                                f"({named(categories)}). Change the request; if the verdict looks wrong, an operator "
                                "can find it under the request id.", "content_filter", "messages")
        raise ApiError(400, f"The answer was withheld by the gateway's guardrails: the judge found it unsafe "
                            f"({named(categories)}). Change the request; if the verdict looks wrong, an operator "
                            "can find it under the request id.", "content_filter")

    def _ask(self, judge: str, prompt: str) -> tuple[str, ...] | None:
        """JUDGE's verdict on PROMPT: None for safe, else the categories; raises Unavailable."""
        rt = self.rt
        spec = rt.router.snapshot.resolve(judge)
        if spec is None or spec.role != "guard" or spec.name != judge:
            raise Unavailable("is not a model of the catalog with role = \"guard\"")
        replica = rt.router.pick(judge, time.monotonic(), None, set())
        if replica is None:
            if spec.on_demand:  # nobody else asks for a judge: the guard says it is wanted
                rt.demand(judge)
                raise Unavailable("runs on demand and is starting")
            raise Unavailable("has no replica in rotation")
        body = json.dumps({"model": judge, "prompt": prompt, "max_tokens": JUDGE_MAX_TOKENS, "temperature": 0,
                           "stream": False}).encode()
        started = time.perf_counter()
        replica.outstanding += 1
        try:
            resp = rt.pool.request(replica.target, "POST", "/v1/completions", body, self.timeout,
                                   time.monotonic() + self.timeout)
            data = resp.read(self.timeout)
            resp.release()
        except UpstreamError as e:
            if e.phase not in ("first_byte", "total"):  # a slow verdict is load, not a broken replica
                replica.breaker.failure(time.monotonic())
            raise Unavailable(f"failed on replica {replica.spec.id} ({e.phase})") from None
        finally:
            replica.outstanding -= 1
            rt.metrics.guard_duration.labels(judge).observe(time.perf_counter() - started)
        if resp.status != 200:
            raise Unavailable(f"answered HTTP {resp.status} on replica {replica.spec.id}")
        replica.breaker.success()
        rt.used(judge)  # an on-demand judge stays up while it judges
        try:
            answer = json.loads(data)
            text = answer["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise Unavailable("gave an answer that is not a completion") from None
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        for field, direction in (("prompt_tokens", "in"), ("completion_tokens", "out")):
            if type(usage.get(field)) is int:
                rt.metrics.tokens.labels(judge, direction).inc(usage[field])
        return parse_verdict(text if isinstance(text, str) else "")


class Held:
    """A stream's answer kept back until the judge has read it (see the top of this module)."""

    def __init__(self, guard: Guard, req, model: ModelSpec, rule: Policy):
        self.guard, self.req, self.model, self.rule = guard, req, model, rule
        self.events: list[bytes] = []
        self.texts: dict[int, list[str]] = {}
        self.said = 0.0

    def keep(self, events: bytes) -> bytes:
        """Keep EVENTS (whole engine events); returns a comment for the client now and then, else nothing."""
        if events:
            self.events.append(events)
            self._read(events)
        if time.monotonic() - self.said < KEEPALIVE:
            return b""
        self.said = time.monotonic()
        return b": the answer is held until the guard has judged it\n\n"

    def _read(self, events: bytes) -> None:
        for line in events.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            try:
                choices = json.loads(line[6:]).get("choices") or ()
            except (ValueError, AttributeError):
                continue
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                parts = self.texts.setdefault(choice.get("index", 0), [])
                if isinstance(delta, dict):
                    parts.append(_text(delta.get("content")))
                    for call in delta.get("tool_calls") or ():
                        function = call.get("function") if isinstance(call, dict) else None
                        if isinstance(function, dict):
                            parts.append(f"{function['name']} " if function.get("name") else "")
                            parts.append(function.get("arguments") or "")
                else:
                    parts.append(_text(choice.get("text")))

    def release(self, tail: bytes) -> bytes:
        """Every event kept, and TAIL, once the judge finds the answer safe; raises ApiError when it does not."""
        if tail:
            self.events.append(tail)
            self._read(tail)
        self.guard.judge_answers(self.req, self.model, self.rule,
                                 ["".join(parts) for _, parts in sorted(self.texts.items())])
        return b"".join(self.events)


def _record(req, verdict: str, categories: str | None) -> None:
    """Note VERDICT on REQ for its usage row, unless a worse one is there already."""
    if req.guard is None or VERDICTS.index(verdict) >= VERDICTS.index(req.guard[0]):
        req.guard = (verdict, categories)


def row(req) -> tuple[str | None, str | None]:
    """The usage row's (guard_verdict, guard_category): None, None where nothing was judged."""
    return req.guard if req is not None and req.guard is not None else (None, None)
