"""`llmgw ctl tool-check MODEL`: whether a model calls tools well enough for coding agents.

Codex, Claude Code, Cline and Continue's agent mode work only through tool
calls: a model that answers in prose where a call was asked for, or writes
arguments that are not JSON, makes every agent session fail in ways that look
like the gateway's fault. This asks the model, through the gateway and with a
real key (the path the agents take), to call a tool: in a whole answer, in a
stream, and through the Responses API that Codex speaks; then it sends the
tool's result back and wants an answer in words. Each step is said with what
went wrong.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}},
                   "required": ["city"]}}}
ASK = "What is the weather in Paris right now? Call the get_weather tool; do not guess."
RESULT = "Sunny, 21 degrees Celsius."


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    ok: bool
    said: str  # what happened, in words


class Gateway:
    def __init__(self, url: str, key: str, timeout: float):
        self.url, self.key, self.timeout = url.rstrip("/"), key, timeout

    def post(self, path: str, body: dict) -> bytes:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST", headers={
            "Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            with e:
                detail = e.read()[:500].decode("utf-8", "replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            hint = {401: " (the key: give one that works, with --key or LLMGW_API_KEY)",
                    403: " (the key may not use this model: an operator's allowlist)",
                    404: " (no such model: `llmgw ctl models` lists them)"}.get(e.code, "")
            raise RuntimeError(f"the gateway answered {e.code}{hint}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"the gateway at {self.url} did not answer: {getattr(e, 'reason', e)}") from None


def _judge_call(name: str | None, arguments: str | None, text: str) -> tuple[bool, str]:
    if name is None:
        return False, f"it answered in words instead of calling the tool: {text.strip()[:120]!r}"
    if name != "get_weather":
        return False, f"it called {name!r}, a tool it was not offered"
    try:
        args = json.loads(arguments or "")
    except ValueError:
        return False, f"its arguments are not JSON: {(arguments or '')[:120]!r}"
    if not isinstance(args, dict) or not isinstance(args.get("city"), str):
        return False, f"its arguments lack the required string `city`: {arguments[:120]!r}"
    return True, f"called get_weather({json.dumps(args)})"


def whole(gw: Gateway, model: str) -> tuple[Step, dict | None]:
    """A chat completion that should be a call; with it, the assistant message to send back."""
    answer = json.loads(gw.post("/v1/chat/completions", {"model": model, "messages": [
        {"role": "user", "content": ASK}], "tools": [TOOL], "max_tokens": 256, "temperature": 0}))
    message = answer["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    call = calls[0]["function"] if calls else {}
    ok, said = _judge_call(call.get("name"), call.get("arguments"), message.get("content") or "")
    return Step("chat completion", ok, said), (message if ok else None)


def streamed(gw: Gateway, model: str) -> Step:
    raw = gw.post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": ASK}],
                                           "tools": [TOOL], "max_tokens": 256, "temperature": 0, "stream": True})
    name, arguments, text = None, "", ""
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices") or []:
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                name = function.get("name") or name
                arguments += function.get("arguments") or ""
    ok, said = _judge_call(name, arguments if name else None, text)
    return Step("streamed chat completion", ok, said)


def responses(gw: Gateway, model: str) -> Step:
    answer = json.loads(gw.post("/v1/responses", {"model": model, "input": ASK, "max_output_tokens": 256,
                                                  "tools": [{"type": "function", **TOOL["function"]}]}))
    calls = [o for o in answer.get("output") or [] if o.get("type") == "function_call"]
    text = " ".join(c.get("text", "") for o in answer.get("output") or [] if o.get("type") == "message"
                    for c in o.get("content") or [])
    ok, said = _judge_call(calls[0].get("name") if calls else None, calls[0].get("arguments") if calls else None,
                           text)
    return Step("Responses API (Codex)", ok, said)


def uses_result(gw: Gateway, model: str, call_message: dict) -> Step:
    call_id = call_message["tool_calls"][0].get("id") or "call_1"
    answer = json.loads(gw.post("/v1/chat/completions", {"model": model, "tools": [TOOL], "max_tokens": 256,
                                                         "temperature": 0, "messages": [
        {"role": "user", "content": ASK}, call_message,
        {"role": "tool", "tool_call_id": call_id, "content": RESULT}]}))
    message = answer["choices"][0]["message"]
    text = (message.get("content") or "").strip()
    if message.get("tool_calls"):
        return Step("tool result", False, "given the tool's result, it called a tool again instead of answering")
    if not text:
        return Step("tool result", False, "given the tool's result, it said nothing")
    return Step("tool result", True, f"answered from it: {text[:120]!r}")


def _read(name: str, step):
    """STEP's answer, or a failed Step where what came back is not the shape its API has."""
    try:
        return step()
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        return Step(name, False, f"its answer could not be read ({type(e).__name__}: {str(e)[:80]})")


def run(gw: Gateway, model: str) -> list[Step]:
    """Every step, in order; a step the gateway refuses ends the check (RuntimeError)."""
    first = _read("chat completion", lambda: whole(gw, model))
    first, message = first if isinstance(first, tuple) else (first, None)
    steps = [first, _read("streamed chat completion", lambda: streamed(gw, model)),
             _read("Responses API (Codex)", lambda: responses(gw, model))]
    if message is not None:
        steps.append(_read("tool result", lambda: uses_result(gw, model, message)))
    return steps
