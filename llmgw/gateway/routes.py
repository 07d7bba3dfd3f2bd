"""Which API each `/v1` path speaks: the kind of request it is and its dialect (llmgw/gateway/dialect.py)."""

from __future__ import annotations

from llmgw.gateway.dialect import OPENAI, Dialect
from llmgw.gateway.messages import MESSAGES
from llmgw.gateway.responses import RESPONSES

ROUTES: dict[str, tuple[str, Dialect]] = {
    "/v1/chat/completions": ("chat", OPENAI),
    "/v1/completions": ("completions", OPENAI),
    "/v1/embeddings": ("embeddings", OPENAI),
    "/v1/responses": ("chat", RESPONSES),
    # Anthropic's Messages API, which Claude Code speaks; "tokens" counts a prompt and generates nothing.
    "/v1/messages": ("chat", MESSAGES),
    "/v1/messages/count_tokens": ("tokens", MESSAGES),
}
MODELS = "/v1/models"
# What a 404 for an unknown path lists.
SERVED = ", ".join([*ROUTES, MODELS])
