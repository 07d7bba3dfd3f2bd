"""How many tokens a request is billed: the engine's count where it covers the request, else what was served.

An engine's `usage` is exact when it speaks for the whole request, and the
gateway takes it as it is. It does not always: llama.cpp reports usage for the
first prompt only when `/v1/completions` is given a list of them (300 prompts
were billed as 4 prompt and 16 completion tokens), and a stream cut short (the
client left, the engine died, a timeout) ends before its usage event (190
tokens read, nothing billed). Then the gateway counts what it served itself,
as a floor, and bills the larger of that and whatever the engine said:
OpenAI bills every prompt and every generated token.

The floor is counted without a tokenizer: every prompt and every answer is
at least one token, a streamed delta carries at least one, and text runs to
at most `BYTES_PER_TOKEN` bytes a token (English averages four). Erring low
keeps an engine's exact count the one billed wherever it is whole.
"""

from __future__ import annotations

import json

BYTES_PER_TOKEN = 6


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def prompt_count(req) -> int:
    return 1 if req.kind == "chat" else len(_inputs(req))


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


def answer_floor(data: bytes) -> int:
    """Completion tokens at least in a whole (not streamed) answer: every choice counted."""
    try:
        choices = json.loads(data).get("choices")
    except (ValueError, AttributeError):
        return 0
    total = 0
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        total += text_floor(text) if isinstance(text, str) else 1
    return total


def trusted(req, usage: dict | None) -> tuple[int | None, int | None] | None:
    """The engine's (prompt, completion) when its USAGE speaks for the whole request; else None."""
    if not usage or prompt_count(req) != 1:
        return None
    return _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))


def billed(req, usage: dict | None, served: int) -> tuple[int, int | None]:
    """(prompt, completion) to bill when the engine's USAGE is missing or partial: the larger of
    what it said and what was served (SERVED: completion tokens counted by the gateway)."""
    usage = usage or {}
    prompt = max(_int(usage.get("prompt_tokens")) or 0, prompt_floor(req))
    if req.kind == "embeddings":
        return prompt, None
    return prompt, max(_int(usage.get("completion_tokens")) or 0, served)
