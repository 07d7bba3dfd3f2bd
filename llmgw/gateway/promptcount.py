"""How many tokens a request's prompt is: at most (`bound`), about (`estimate`), or exactly (`count`).

`bound` is what admission holds a request to before anything is counted: the
body's bytes, plus what a chat template adds that the body does not hold. It
is an upper bound for the byte-level BPE vocabularies engines serve (GPT-2's,
Llama 3's, Qwen's, SmolLM's) and for SentencePiece with byte fallback (Llama
2's, Mistral's): no token is shorter than a byte, and the JSON around each
message (`{"role":"user","content":""}`, 28 bytes) is more than the markup the
template puts around it (about five tokens). What is left is said once a
prompt: a BOS, a default system prompt, the generation prompt, a tool
preamble, `TEMPLATE_TOKENS` at most. It was bytes over four, which English
meets but a prompt of symbols runs at three times: eight clients were
served 2,584 tokens in 40 s against a limit of 1,000 a minute.

`count` is the engine's own count of a chat, template included, for
Anthropic's `/v1/messages/count_tokens`, for a request the bound alone kept
out of a tokens-a-minute limit, and for the prompt of a stream cut before
the engine's usage came. Best first:
- llama.cpp renders the chat with the model's template (`POST
  /apply-template`, tools included) and counts that (`POST /tokenize`): what
  the model will read, to the token.
- vLLM counts a chat on `POST /tokenize` itself, template included (`count`);
  llama.cpp and the sim read the same request's `content`, the chat's text
  (messages, tool calls and tool schemas, without the template's markup),
  and answer `tokens`. One request serves both, each engine reading its fields.
- An engine that does neither (SGLang), or no replica ready: `estimate`,
  the body's bytes over four, what English text runs at (count_tokens
  answers it; a bound would tell a client its prompt is four times longer).
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


# Tokens a chat template may add once a prompt, beyond what the body's bytes cover: SmolLM2's adds 30 (its
# default system prompt), Llama 3's date lines about 25, tool preambles (Llama 3, Qwen 2.5, Hermes) 100 to
# 200 besides their default system prompts.
TEMPLATE_TOKENS = 256


def bound(raw: bytes) -> int:
    """The most tokens the prompt of RAW, a request's body, can be (see the top of this module)."""
    return len(raw) + TEMPLATE_TOKENS


def estimate(raw: bytes) -> int:
    """About how many tokens the prompt of RAW is, for text in English."""
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
