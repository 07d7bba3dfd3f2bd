"""Guardrails: a judge model in Llama Guard 3's format reads prompts and answers, and refuses the unsafe.

A model of the catalog with `role = "guard"` is a judge: never listed for
clients, never served to them. `[guard]` names the judge every model is
checked by, what it reads (`prompts`, `answers`, `both`, `none`) and what
passes when it cannot judge (`fail = "closed"`: nothing, 503; `"open"`:
everything, counted and logged); a model's own `guard` table overrides any of
the three. Docs: docs/guardrails.md.

The judge is asked as Llama Guard 3 was trained: its whole prompt (the
categories S1-S14, or those its own `guard.categories` writes in their place,
the conversation as `User:` and `Agent:` turns, the
question about the last turn) written here and sent as a plain completion, so
that neither the engine's chat template (Llama Guard's raises on a system or
tool message, which every agent sends) nor its default categories decide what
it reads. It answers `safe`, or `unsafe` and a line of categories. Everything
the client wrote (every message, earlier assistant turns too, tools, formats,
fields the engine may render) is one `User` turn, so that the question about
the last turn is about all of it; the answer is the `Agent` turn after it.
Client and engine text cannot rewrite that prompt (`neutral`), and no piece
of it is longer than `guard.max_prompt_bytes`: a longer text is judged in
pieces, unsafe if any piece is.

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

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import re
import time

from llmgw.gateway import chatout
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
# Fields of a request that carry no text to the model: sampling, limits, delivery, and the choice among
# tools it was offered. Every other field is judged, shown as `[field] value`, since an engine or its chat
# template may render it: tools (names, descriptions, schemas), response_format, a completion's suffix,
# chat_template_kwargs, and fields this gateway does not know but passes on.
UNREAD = frozenset((
    "model", "messages", "prompt", "stream", "stream_options", "user", "metadata", "store", "max_tokens",
    "max_completion_tokens", "n_predict", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "typical_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "repeat_penalty", "seed", "stop",
    "logit_bias", "logprobs", "top_logprobs", "echo", "parallel_tool_calls", "tool_choice", "cache_prompt"))
# A message's fields read otherwise (its role is its label; content and tool_calls are read as text) or
# carrying no text (which call a tool result answers).
UNREAD_IN_MESSAGE = frozenset(("role", "content", "tool_calls", "tool_call_id"))
# What in client or engine text could rewrite the judge's prompt: Llama 3's special tokens (llama.cpp and
# vLLM parse them in a completion's prompt), the template's own markers, and a line opening a turn.
SPECIAL_TOKEN = re.compile(r"<\||\|>")
MARKER = re.compile(r"<(?=\s*(?:BEGIN|END)\b)", re.IGNORECASE)
TURN = re.compile(r"^(\s*)(?=(?:User|Agent)\s*:)", re.IGNORECASE | re.MULTILINE)
# Safe verdicts a worker remembers, by the judge's whole prompt: pieces are cut from the start, tools
# first, so each turn of an agent's conversation repeats the pieces of the turn before exactly.
REMEMBERED = 4096
# Pieces of a long text overlap by 1/OVERLAP of a piece, so that a sentence cut at a boundary is also read
# whole.
OVERLAP = 8


@dataclasses.dataclass(frozen=True)
class Policy:
    judge: str
    prompts: bool
    answers: bool
    fail_open: bool


class Unavailable(Exception):
    """The judge could not judge: WHY is for the client, DETAIL (its replica, its own words) for the log only."""

    def __init__(self, why: str, detail: str = ""):
        super().__init__(why)
        self.why, self.detail = why, detail


class Unreadable(Exception):
    """The judge refused what it was given to read (HTTP 400 or 413: longer than its context). Nothing passes
    for this reason, whatever guard.fail says: a client could otherwise make any prompt too long to judge."""


def policy(cfg, model: ModelSpec) -> Policy | None:
    """MODEL's guardrails: `[guard]` with the model's own `guard` over it; None where nothing is judged."""
    chosen = {"model": cfg["guard.model"], "check": cfg["guard.check"], "fail": cfg["guard.fail"], **dict(model.guard)}
    if not chosen["model"] or chosen["check"] == "none" or model.role == "guard":
        return None
    return Policy(chosen["model"], chosen["check"] in ("prompts", "both"), chosen["check"] in ("answers", "both"),
                  chosen["fail"] == "open")


@functools.lru_cache(maxsize=64)
def judge_categories(written: tuple[str, ...] | None) -> dict[str, str]:
    """A judge's categories by code (S1, S2, ...): the ones its catalog entry writes (`guard.categories`), in
    their order, or Llama Guard 3's own."""
    return {f"S{i}": text for i, text in enumerate(written, 1)} if written else CATEGORIES


@functools.lru_cache(maxsize=64)
def _category_lines(written: tuple[str, ...] | None) -> str:
    return "\n".join(f"{code}: {text}{'' if text.endswith('.') else '.'}"
                     for code, text in judge_categories(written).items())


def named(categories: tuple[str, ...], names: dict[str, str] = CATEGORIES) -> str:
    """`S1 Violent Crimes, S10 Hate`: codes a client can look up, with NAMES (the judge's) a person can read."""
    return ", ".join(f"{c} {names[c]}" if c in names else c for c in categories)


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


def _shown(value) -> str:
    """A field's value as the judge reads it: a string as itself, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _fields(obj: dict, unread: frozenset) -> list[str]:
    return [f"[{key}] {_shown(value)}" for key, value in obj.items() if key not in unread and value is not None]


def prompt_text(req) -> str:
    """Everything of REQ a model reads, as one text: the client wrote all of it, earlier assistant turns
    included, so it is all the User's. Raises ApiError for a prompt a text judge cannot read."""
    parts = _fields(req.body, UNREAD)
    if req.kind == "completions":
        prompt = req.body["prompt"]
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not all(isinstance(p, str) for p in prompts):
            raise ApiError(400, f"{req.model} is guarded, and its judge reads text: send the prompt as text, "
                                "not as token ids.", "invalid_request", "prompt")
        return "\n\n".join([*parts, *prompts])
    for message in req.body["messages"]:
        said = [_text(message.get("content")), _calls(message.get("tool_calls")),
                *_fields(message, UNREAD_IN_MESSAGE)]
        parts.append(f"[{message.get('role')}] " + "\n".join(t for t in said if t))
    return "\n\n".join(parts)


def neutral(text: str) -> str:
    """TEXT unable to rewrite the judge's prompt: special tokens broken (`<|eot_id|>` reads `< |eot_id| >`),
    the template's markers bracketed otherwise (`(BEGIN CONVERSATION>`), a line opening a turn quoted
    (`> User:`)."""
    text = SPECIAL_TOKEN.sub(lambda m: "< |" if m.group() == "<|" else "| >", text)
    return TURN.sub(r"\1> ", MARKER.sub("(", text))


def judge_prompt(user: str, agent: str | None = None, categories: tuple[str, ...] | None = None) -> str:
    """Llama Guard 3's prompt asking about AGENT's answer to USER, or about USER where AGENT is None, in
    CATEGORIES (a judge's `guard.categories`; None: Llama Guard 3's own)."""
    conversation = f"User: {neutral(user)}" + (f"\n\nAgent: {neutral(agent)}" if agent is not None else "")
    return PROMPT.format(role="User" if agent is None else "Agent", categories=_category_lines(categories),
                         conversation=conversation)


def _size(text: str) -> int:
    return len(text.encode("utf-8", "replace"))


def pieces(text: str, size: int) -> list[str]:
    """TEXT in pieces of at most SIZE bytes of UTF-8, each overlapping the one before by an OVERLAPth."""
    data = text.encode("utf-8", "replace")
    if len(data) <= size:
        return [text]
    step = size - size // OVERLAP
    return [data[i:i + size].decode("utf-8", "ignore") for i in (*range(0, len(data) - size, step), len(data) - size)]


def tail(text: str, size: int) -> str:
    """The last SIZE bytes of TEXT: the most recent part of a conversation, as context for an answer."""
    data = text.encode("utf-8", "replace")
    return text if len(data) <= size else data[len(data) - size:].decode("utf-8", "ignore")


def parse_verdict(text: str) -> tuple[str, ...] | None:
    """The categories of an `unsafe` verdict, None for `safe`; raises Unavailable for anything else."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines and lines[0].lower() == "safe":
        return None
    if lines and lines[0].lower() == "unsafe":
        codes = tuple(c.strip().upper() for c in lines[1].split(",") if c.strip()) if len(lines) > 1 else ()
        return codes or ("unnamed",)
    raise Unavailable("its verdict could not be read", f"it answered {text.strip()[:200]!r}")


def _said(message: dict) -> str:
    """What an answer's MESSAGE says: its reasoning (a chat template may show it to the next turn, and the
    client reads it), its text, its tool calls."""
    texts = (_text(message.get("reasoning_content")), _text(message.get("reasoning")),
             _text(message.get("content")), _calls(message.get("tool_calls")))
    return "\n".join(t for t in texts if t)


def answer_texts(data: bytes) -> list[str]:
    """Each choice's text in a whole chat or completion answer (reasoning and tool calls included)."""
    try:
        choices = json.loads(data).get("choices") or []
    except (ValueError, AttributeError):
        return []
    texts = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(message, dict):
            texts.append(_said(message))
        elif isinstance(choice, dict):
            texts.append(_text(choice.get("text")))
    return texts


class Guard:
    """The proxy's guardrails: one per worker, holding the runtime it reaches judges through."""

    def __init__(self, runtime):
        self.rt = runtime
        self.timeout = runtime.cfg["guard.timeout"]
        self.max_bytes = runtime.cfg["guard.max_prompt_bytes"]
        self.max_pieces = runtime.cfg["guard.max_pieces"]
        self.safe: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # see REMEMBERED

    def check_prompt(self, req, model: ModelSpec) -> None:
        """Judge REQ's prompt where MODEL's policy says so, a piece at a time where it is longer than
        guard.max_prompt_bytes; raises ApiError (400 unsafe or unreadable, 503 unjudged and closed)."""
        rule = policy(self.rt.cfg, model)
        if rule is None or not rule.prompts or req.kind == "embeddings":
            return
        cut = pieces(prompt_text(req), self.max_bytes)
        if len(cut) > self.max_pieces:
            # Each piece is a judge's call the caller's limits do not pay for: an 8.9 MB prompt was 640.
            _record(req, "unjudged", None)
            raise ApiError(400, f"This prompt was refused by the gateway's guardrails: {model.name} is guarded, "
                                f"and this conversation is too long to judge ({len(cut)} pieces of "
                                f"{self.max_bytes} bytes; at most {self.max_pieces}, guard.max_pieces). Shorten "
                                "the conversation or start a new one.", "guard_too_long", "messages")
        for piece in cut:
            self._judge(req, model, rule, "prompt", piece, None)

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
        """Judge each of TEXTS as the answer to REQ: a long one in pieces of half the bound, each after as
        much of the end of the prompt as the other half holds (the prompt itself is the prompt check's)."""
        asked = prompt_text(req)
        for text in texts:
            for piece in pieces(text, self.max_bytes // 2):
                self._judge(req, model, rule, "answer", tail(asked, self.max_bytes - _size(piece)), piece)

    def _judge(self, req, model: ModelSpec, rule: Policy, checked: str, user: str, agent: str | None) -> None:
        m = self.rt.metrics
        judge = self.rt.router.snapshot.models.get(rule.judge)
        written = dict(judge.guard).get("categories") if judge is not None else None
        prompt = judge_prompt(user, agent, written)
        seen = hashlib.blake2b(f"{rule.judge}\n{prompt}".encode("utf-8", "replace"), digest_size=16).digest()
        if seen in self.safe:  # the judge's verdict at temperature 0 would be the same
            self.safe.move_to_end(seen)
            m.guard_remembered.labels(rule.judge).inc()
            _record(req, "safe", None)
            return
        try:
            categories = self._ask(rule.judge, prompt)
        except Unreadable as e:
            _record(req, "unjudged", None)
            log.warning("refused a request for %s: the judge %s could not read a piece of its %s (%d bytes): %s",
                        model.name, rule.judge, checked, _size(agent if agent is not None else user), e)
            done = "This prompt was refused" if checked == "prompt" else "The answer was withheld"
            raise ApiError(400, f"{done} by the gateway's guardrails: {model.name} is guarded by the judge "
                                f"{rule.judge}, which refused to read a part of this {checked} as too long for it, "
                                "and nothing passes unjudged for that reason. Shorten the conversation or start a "
                                f"new one; if this recurs, an operator should lower guard.max_prompt_bytes to what "
                                f"{rule.judge}'s context holds.", "guard_too_long",
                           "messages" if checked == "prompt" else None) from None
        except Unavailable as e:
            m.guard_unavailable.labels(rule.judge, "open" if rule.fail_open else "closed").inc()
            _record(req, "unjudged", None)
            if rule.fail_open:
                log.warning("the %s of a request for %s passed unjudged (guard.fail = open): the judge %s: %s %s",
                            checked, model.name, rule.judge, e.why, e.detail)
                return
            log.warning("refused a request for %s: its %s could not be judged (guard.fail = closed): the judge %s: "
                        "%s %s", model.name, checked, rule.judge, e.why, e.detail)
            raise ApiError(503, f"{model.name} is guarded by the judge {rule.judge}, which cannot judge this "
                                f"{checked} now: {e.why}. Try again shortly; an operator should check that "
                                f"{rule.judge} runs (with guard.fail = \"closed\", nothing passes unjudged) and "
                                "find the details in the gateway's log under the request id.",
                           "guard_unavailable", retry_after=5) from None
        if categories is None:
            m.guard_verdicts.labels(rule.judge, checked, "safe", "").inc()
            self.safe[seen] = None
            if len(self.safe) > REMEMBERED:
                self.safe.popitem(last=False)
            _record(req, "safe", None)
            return
        for code in categories:
            m.guard_verdicts.labels(rule.judge, checked, "unsafe", code).inc()
        _record(req, f"{checked}_unsafe", ",".join(categories))
        found = named(categories, judge_categories(written))
        if checked == "prompt":
            raise ApiError(400, f"This prompt was refused by the gateway's guardrails: the judge found it unsafe "
                                f"({found}). Change the request; if the verdict looks wrong, an operator "
                                "can find it under the request id.", "content_filter", "messages")
        raise ApiError(400, f"The answer was withheld by the gateway's guardrails: the judge found it unsafe "
                            f"({found}). Change the request; if the verdict looks wrong, an operator "
                            "can find it under the request id.", "content_filter")

    def _ask(self, judge: str, prompt: str) -> tuple[str, ...] | None:
        """JUDGE's verdict on PROMPT: None for safe, else the categories; raises Unavailable or Unreadable."""
        rt = self.rt
        spec = rt.router.snapshot.resolve(judge)
        if spec is None or spec.role != "guard" or spec.name != judge:
            raise Unavailable("it is not a model of the catalog with role = \"guard\"")
        replica = rt.router.pick(judge, time.monotonic(), None, set())
        if replica is None:
            if spec.on_demand:  # nobody else asks for a judge: the guard says it is wanted
                rt.demand(judge)
                raise Unavailable("it runs on demand and is starting")
            raise Unavailable("it has no replica in rotation")
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
            raise Unavailable("it did not answer in time" if e.phase in ("first_byte", "total") else
                              "it failed to answer", f"on replica {replica.spec.id} ({e.phase})") from None
        finally:
            replica.outstanding -= 1
            rt.metrics.guard_duration.labels(judge).observe(time.perf_counter() - started)
        said = f"on replica {replica.spec.id}: HTTP {resp.status} {data[:300]!r}"
        if resp.status in (400, 413):  # the prompt is ours and well formed: what it refuses is its length
            raise Unreadable(said)
        if resp.status != 200:
            raise Unavailable(f"it answered an error (HTTP {resp.status})", said)
        replica.breaker.success()
        rt.used(judge)  # an on-demand judge stays up while it judges
        try:
            answer = json.loads(data)
            text = answer["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise Unavailable("it gave an answer that is not a completion", said) from None
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
        self.texts: dict[int, tuple[list[str], list[str]]] = {}  # by choice: its reasoning, what it says
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
        for chunk in chatout.chunks(events):
            for choice in chatout.a_list(chunk.get("choices") if chunk is not None else None):
                if not isinstance(choice, dict):
                    continue
                index = choice.get("index", 0)
                thought, said = self.texts.setdefault(index if isinstance(index, int) else 0, ([], []))
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    thought.append(chatout.reasoning(delta))
                    said.append(chatout.a_string(delta.get("content")))
                    for piece in chatout.a_list(delta.get("tool_calls")):
                        if isinstance(piece, dict):
                            call = chatout.call(piece)
                            said.append(f"{call.name} {call.arguments}" if call.name else call.arguments)
                else:
                    said.append(chatout.a_string(choice.get("text")))

    def release(self, tail: bytes) -> bytes:
        """Every event kept, and TAIL, once the judge finds the answer safe; raises ApiError when it does not."""
        if tail:
            self.events.append(tail)
            self._read(tail)
        self.guard.judge_answers(self.req, self.model, self.rule, [
            "\n".join(t for t in ("".join(thought), "".join(said)) if t)
            for thought, said in self.texts.values()])
        return b"".join(self.events)


def _record(req, verdict: str, categories: str | None) -> None:
    """Note VERDICT on REQ for its usage row, unless a worse one is there already."""
    if req.guard is None or VERDICTS.index(verdict) >= VERDICTS.index(req.guard[0]):
        req.guard = (verdict, categories)


def row(req) -> tuple[str | None, str | None]:
    """The usage row's (guard_verdict, guard_category): None, None where nothing was judged."""
    return req.guard if req is not None and req.guard is not None else (None, None)
