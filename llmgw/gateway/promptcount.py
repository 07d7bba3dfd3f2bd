"""How many tokens a chat request's prompt is, asked of an engine without generating anything.

For routes of kind "tokens" (Anthropic's `/v1/messages/count_tokens`): the
count is the engine's own where it can give one, and an estimate otherwise,
best first:
- llama.cpp renders the chat with the model's template (`POST
  /apply-template`, tools included) and counts that (`POST /tokenize`): what
  the model will read, to the token.
- vLLM counts a chat on `POST /tokenize` itself, template included (`count`);
  llama.cpp and the sim read the same request's `content`, the chat's text
  (messages, tool calls and tool schemas, without the template's markup),
  and answer `tokens`. One request serves both, each engine reading its fields.
- An engine that does neither (SGLang), or no replica ready: the body's
  bytes over four, the estimate admission makes.
"""

from __future__ import annotations

import json
from typing import Callable

# POST PATH with a JSON body to the engine: its JSON answer, or None for anything but a 200 with JSON.
Post = Callable[[str, dict], "dict | None"]


def chat_text(chat: dict) -> str:
    """The text a chat's prompt is made of, as the model reads it minus the template's markup."""
    texts = []
    for message in chat["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content if part.get("type") == "text")
        for call in message.get("tool_calls") or []:
            texts.append(call["function"]["name"] + " " + call["function"].get("arguments", ""))
    if chat.get("tools"):
        texts.append(json.dumps(chat["tools"], ensure_ascii=False))
    return "\n".join(texts)


def estimate(raw: bytes) -> int:
    return len(raw) // 4


def count(post: Post, chat: dict, served: str) -> int | None:
    """The tokens of CHAT's prompt as the engine behind POST counts them (SERVED: its name for the model)."""
    templated = post("/apply-template", {key: chat[key] for key in ("messages", "tools") if key in chat})
    if templated is not None and isinstance(templated.get("prompt"), str):
        # The template wrote the special tokens (BOS and the role markers) as text; they are parsed, not added.
        tokens = post("/tokenize", {"content": templated["prompt"], "add_special": False})
        if tokens is not None and isinstance(tokens.get("tokens"), list):
            return len(tokens["tokens"])
    asked = {"model": served, "messages": chat["messages"], "add_generation_prompt": True,
             "content": chat_text(chat), "add_special": True}
    if chat.get("tools"):
        asked["tools"] = chat["tools"]
    tokens = post("/tokenize", asked)
    if tokens is None:
        return None
    if isinstance(tokens.get("count"), int):
        return tokens["count"]
    return len(tokens["tokens"]) if isinstance(tokens.get("tokens"), list) else None
