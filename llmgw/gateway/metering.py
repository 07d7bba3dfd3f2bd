"""How many tokens a request is billed: the engine's count where it covers the request, else what was served.

An engine's `usage` is exact when it speaks for the whole request, and the
gateway takes it as it is. It does not always. llama.cpp runs one task per
prompt and per choice (`n`), and a whole answer's `usage` is the first task's
alone: 300 prompts were billed as 4 prompt and 16 completion tokens, four
choices of 30 tokens as 30. A stream carries one usage report per task
instead, which summed are exact (`trusted`'s REPORTS). A stream cut short
(the client left, the engine died, a timeout) ends before its reports (190
tokens read, nothing billed).

Where the usage is partial, the gateway counts what it served and bills the
larger of that and whatever the engine said: OpenAI bills every prompt and
every generated token. For a whole answer with several prompts or choices it
asks the replica's tokenizer (`POST /tokenize`, llama.cpp's) for the prompts'
and the answers' tokens: the floor below assumes six bytes a token, and text
dense in tokens (digits, one token each with its space) runs at two, so
twenty prompts of 599 tokens were billed 2,000 for 11,980 processed. Asking
costs a local round trip on the rare request that needs it, and none on the
common one (one prompt, one choice), which is why it is done rather than
refusing lists of prompts, which clients batch with for good reason.

The floor, used where the tokenizer cannot be asked (an engine without
`/tokenize`, what a cut stream delivered; its prompt the replica counts,
template included, in `billing.Billing.billed`), is counted without one: every
prompt and every answer is at least one token, a streamed delta carries at
least one, text runs to at most `BYTES_PER_TOKEN` bytes a token (English
averages four).
Neither is needed for a choice that stopped at its limit as the first did: it
generated as many tokens as the usage says the first did (`settle`).
Erring low keeps an engine's exact count the one billed wherever it is whole.

An engine's figures are believed only within what the request could have
used (`capped`): its prompt no more than the bound admission held it to
(`promptcount.bound`), its completion no more than its output limit for every
prompt and choice. A count that is not one (negative, a fraction, a boolean,
past what the usage table holds) is taken as not said, and the gateway's own
count is billed. A hostile or broken engine reported 1,000,000 completion
tokens for `max_tokens: 2`, which were billed; and -5, which the metrics'
counter refused after the answer had started: the client got a 500 page and
the usage row was lost.
"""

from __future__ import annotations

import json

from llmgw.gateway import promptcount

BYTES_PER_TOKEN = 6
MOST_TOKENS = 2**31 - 1  # what the usage table's token columns hold (32 bits on PostgreSQL)


def count(value) -> int | None:
    """VALUE when it is a token count an engine can have made, a whole number from 0 to MOST_TOKENS;
    None otherwise, which callers take as not said."""
    return value if type(value) is int and 0 <= value <= MOST_TOKENS else None


def text_floor(text) -> int:
    """Tokens at least in one prompt or answer TEXT (a list of token ids counts exactly)."""
    if isinstance(text, str):
        return len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN + 1
    if isinstance(text, list) and all(isinstance(t, int) for t in text):
        return max(1, len(text))
    return 1


def _inputs(req) -> list:
    """The prompts of REQ as the engine meters them: one per item of a list of prompts or inputs."""
    if req.kind == "chat":
        return [req.body.get("messages")]
    value = req.body.get("prompt" if req.kind == "completions" else "input")
    # A list of token ids is one prompt; a list of strings or of token lists is several.
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return value
    return [value]


def text_prompts(req) -> list[str]:
    """REQ's prompts given as text (a completion's or an embedding's), for a tokenizer to count."""
    return [p for p in _inputs(req) if isinstance(p, str)]


def id_prompts(req) -> int:
    """The tokens of REQ's prompts given as token ids (a completion's or an embedding's), which count themselves."""
    return sum(len(p) for p in _inputs(req) if isinstance(p, list))


def prompt_count(req) -> int:
    return 1 if req.kind == "chat" else len(_inputs(req))


def choices(req) -> int:
    """Answers asked for each prompt (`n`); an embedding has one."""
    n = req.body.get("n") if req.kind != "embeddings" else None
    return n if type(n) is int and n > 1 else 1


def answers(req) -> int:
    """Answers the request may generate: one per prompt and choice."""
    return prompt_count(req) * choices(req)


def _chat_floor(messages) -> int:
    total = 0
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        total += text_floor(content) if isinstance(content, str) else 1
    return max(1, total)


def prompt_floor(req) -> int:
    """Prompt tokens at least in REQ, every prompt of a list counted."""
    if req.kind == "chat":
        return _chat_floor(req.body.get("messages"))
    return sum(text_floor(p) for p in _inputs(req))


def answer_choices(data: bytes) -> list[dict]:
    """The choices of a whole (not streamed) answer."""
    try:
        found = json.loads(data).get("choices")
    except (ValueError, AttributeError):
        return []
    return [c for c in found if isinstance(c, dict)] if isinstance(found, list) else []


def _choice_text(choice: dict) -> str | None:
    """What a choice generated, as text: its content, and the name and arguments of each tool call
    (a choice that only called a tool, with 2 KB of arguments, was counted as one token)."""
    message = choice.get("message")
    if not isinstance(message, dict):
        text = choice.get("text")
        return text if isinstance(text, str) else None
    parts = [message.get("content")]
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts += [function.get("name"), function.get("arguments")]
    texts = [p for p in parts if isinstance(p, str)]
    return "".join(texts) if texts else None


def settle(choices: list[dict], usage: dict | None) -> tuple[int, list[dict]]:
    """(completion tokens the engine's USAGE settles among a whole answer's CHOICES, the choices it leaves).

    The usage speaks for the first choice. When that one stopped for "length", every choice that stopped
    so too generated as many tokens, exactly: counting them again would miss tokens that render as
    nothing (an end-of-text token forced under `ignore_eos`: 113 of 120) and overcount where the text
    tokenizes longer than it was generated (121 of 120). It errs high only for a list of prompts where a
    longer one filled the context before its limit.
    """
    first = count((usage or {}).get("completion_tokens")) if choices and _stopped(choices[0]) else None
    if not first:
        return 0, choices
    rest = [c for c in choices if not _stopped(c)]
    return first * (len(choices) - len(rest)), rest


def answer_floor(choices: list[dict]) -> int:
    """Completion tokens at least in CHOICES of a whole answer (`answer_choices`), every one counted."""
    total = 0
    for choice in choices:
        text = _choice_text(choice)
        total += text_floor(text) if text is not None else 1
    return total


def _stopped(choice: dict) -> bool:
    """Whether CHOICE stopped at its length limit."""
    return choice.get("finish_reason") == "length"


def to_tokenize(req, choices: list[dict], rest: list[dict]) -> tuple[list[str], list[str]]:
    """What to ask the engine's tokenizer for a whole answer whose usage is partial: the text prompts
    when there are several, and the texts of REST, the CHOICES the usage does not settle (`settle`), when
    there are several choices (nothing when either is one: the usage speaks for it)."""
    prompts = text_prompts(req) if prompt_count(req) > 1 else []
    texts = [t for c in rest if (t := _choice_text(c)) is not None] if len(choices) > 1 else []
    return prompts, texts


def counted_prompts(req, tokenized: int) -> int:
    """Prompt tokens of REQ's several prompts given TOKENIZED, the tokenizer's count of its text prompts
    (`to_tokenize`): a prompt of token ids counts itself. 0 for one prompt, which the usage speaks for."""
    if prompt_count(req) == 1:
        return 0
    return tokenized + id_prompts(req)


def trusted(req, usage: dict | None, reports: int = 1) -> tuple[int, int | None] | None:
    """The engine's (prompt, completion), `capped`, when its USAGE speaks for the whole request; else None.

    REPORTS: how many usage reports USAGE sums. One per answer (prompt and choice) is the whole
    request; each choice reports its prompt again, which is billed once, as OpenAI does. A figure
    missing or not a count leaves it to `billed`."""
    if not usage or reports != answers(req):
        return None
    prompt = count(usage.get("prompt_tokens"))
    completion = count(usage.get("completion_tokens")) if req.kind != "embeddings" else None
    if prompt is None or (completion is None and req.kind != "embeddings"):
        return None
    return capped(req, prompt // choices(req), completion)


def billed(req, usage: dict | None, served: int, prompt: int = 0) -> tuple[int, int | None]:
    """(prompt, completion) to bill when the engine's USAGE is missing or partial: the larger of what
    it said and what was served (SERVED: completion tokens, PROMPT: prompt tokens counted by the gateway),
    `capped`."""
    usage = usage or {}
    prompt = max(count(usage.get("prompt_tokens")) or 0, prompt_floor(req), prompt)
    if req.kind == "embeddings":
        return capped(req, prompt, None)
    return capped(req, prompt, max(count(usage.get("completion_tokens")) or 0, served))


def capped(req, prompt: int, completion: int | None) -> tuple[int, int | None]:
    """PROMPT and COMPLETION held to what REQ could have used: no more prompt than the bound it was
    admitted with, no more completion than its output limit (where known) for each of its answers."""
    prompt = min(prompt, promptcount.bound(req.raw))
    if completion is not None and req.max_tokens is not None:
        completion = min(completion, req.max_tokens * answers(req))
    return prompt, completion
