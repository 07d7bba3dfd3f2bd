"""`llmgw sim`: a simulated engine, for tests and benchmarks that need many replicas or exact timing.

It answers the four OpenAI routes the way vLLM does (streams end with
`[DONE]`, usage when asked for it, vLLM's metric names on `/metrics`), with a
time to first token and a token rate you choose, a bounded number of requests
running at once (the rest wait, and are reported waiting), a prefix cache
modelled on vLLM's (below), and faults on demand: fail a fraction of requests (its health check too, as a
sick engine's does), die partway through the Nth, stall mid-stream, or stay
loading. Like llama.cpp it answers 500 to some malformed requests (tools that
are not a list, a message name that is not a string, a text part without
text), runs one task per prompt and per choice (`n`), reports a whole
answer's usage for the first task only and a stream's once per task, and
counts tokens on `POST /tokenize` (a word a token). It generates no text
worth reading unless scripted, and is never the default engine.

Scripts, for tests of what passes through a gateway: `reply` is the text
every answer gives (a guard judge's `safe`); `tool_calls` are (NAME,
ARGUMENTS) pairs: a chat that offers a tool so named, and holds no tool
result yet, is answered with a call of it, streamed as vLLM and OpenAI stream
calls; a chat whose last message is a tool result is answered `The tool said:
` and that result, so a test sees the output went back to the model.
`reasoning` is a chat answer's `reasoning_content`, sent before its text as
vLLM sends a reasoning model's; `reply_if` are (WORD, TEXT) pairs: a prompt
holding WORD is answered TEXT (a judge that finds one word unsafe);
`max_context` answers 400 to a prompt of more tokens, as llama.cpp does.
`gather` holds every first token until that many requests run at once (the
time to first token is then the longest it waits): a concurrency test proves
its peak however slowly a busy machine opens the connections.

The prefix cache, for comparing routing policies without GPUs: a prompt's
time to first token is `ttft_ms` plus `prefill_ms_per_token` for each of its
tokens not already cached. Prefills run one at a time, as a GPU's compute
allows, so a replica given many long uncached prompts queues them. The cache
holds whole blocks of 16 tokens, each named by its own tokens and every
token before it (vLLM's hashing, so only a prompt's leading blocks can hit),
at most `prefix_cache_tokens` tokens, the least recently used evicted first
and a prompt's tail before its head (vLLM frees a finished request's blocks
in that order). A prompt's blocks are kept once prefilled and an answer's
once it is complete, so a conversation's next turn finds its history. What it
leaves out: blocks of running requests can be evicted here (vLLM pins them),
and a cancelled answer keeps nothing. `vllm:prefix_cache_queries_total` and
`vllm:prefix_cache_hits_total` count tokens, as vLLM's do.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import json
import os
import random
import re
import socket
import time

import gevent
import gevent.event
from gevent.lock import BoundedSemaphore
from gevent.pywsgi import WSGIServer

from llmgw import addresses
from llmgw.engines import simranks
from llmgw.procs import raise_fd_limit

BLOCK_TOKENS = 16  # vLLM's default block size: only whole blocks are cached
# Characters of a tool call's arguments per streamed delta: several deltas for any real call, as an
# engine sends one per token or so, so a client that keeps only the last fragment is caught.
ARGUMENT_FRAGMENT = 6


@dataclasses.dataclass
class SimOptions:
    model: str = "sim"
    replica: str = "sim"
    ttft_ms: float = 50.0
    tokens_per_s: float = 50.0  # 0: as fast as it can write
    max_concurrency: int = 0  # 0: no limit
    max_queue: int = -1  # with max_concurrency: requests allowed to wait; beyond, 429 (-1: no limit)
    default_tokens: int = 16
    prefill_ms_per_token: float = 0.0  # added to ttft_ms for each prompt token not in the prefix cache
    prefix_cache_tokens: int = 65536  # 0: nothing is cached
    fail_rate: float = 0.0
    die_after: int = 0  # 0: never; N: exit partway through the Nth request
    stall_after_tokens: int = -1  # -1: never; K: stop sending after K tokens, keep the connection open
    keepalive_ms: float = 0.0  # 0: never; N: a comment event every N ms while a stream's first token is awaited
    embedding_dims: int = 16
    loading: bool = False  # answer 503 "Loading model" to everything, /health included, as llama.cpp does
    api_key: str | None = None  # as llama.cpp's: every route but /health wants `Authorization: Bearer KEY`
    reply: str | None = None  # the text of every answer (a word and its spaces a token), instead of tok0 tok1...
    tool_calls: tuple[tuple[str, str], ...] = ()  # (NAME, JSON ARGUMENTS): called when offered, see the top
    reasoning: str | None = None  # a chat answer's reasoning_content, streamed before its text
    reply_if: tuple[tuple[str, str], ...] = ()  # (WORD, TEXT): a prompt holding WORD is answered TEXT
    max_context: int = 0  # 0: no limit; N: a prompt of more than N tokens is answered 400
    gather: int = 0  # 0: never; N: the first token waits until N requests run at once (at most ttft_ms)
    # Answer 200 with a body that is not JSON, and end a stream with an error event after its first token:
    # what a broken engine, or a proxy in front of one, sends.
    garbled: bool = False
    # A rank of a replica over several nodes (llmgw/engines/simranks.py): RANKS of them in GROUP, meeting at
    # MASTER (rank 0's HOST:PORT); rank 0 serves HTTP, the others run headless.
    ranks: int = 1
    rank: int = 0
    group: str = ""
    master: str | None = None


class SimEngine:
    def __init__(self, options: SimOptions, seed: int | None = None):
        self.o = options
        self.rng = random.Random(seed)
        self.slots = BoundedSemaphore(options.max_concurrency) if options.max_concurrency else None
        self.running = 0
        self.peak = 0  # most requests running at once, for tests that must prove concurrency
        self.held_peak = 0  # most requests held at once, running and waiting: what a gateway let through
        self.waiting = 0
        self.requests = 0
        self.scrapes = 0  # reads of /metrics, this one included: tests wait on a gateway's rounds with it
        self.cancelled = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cache_queries = 0
        self.cache_hits = 0
        self.cache = PrefixCache(options.prefix_cache_tokens)
        self.prefilling = BoundedSemaphore(1)
        self.gathered = gevent.event.Event()
        self.gathering = simranks.Gathering(options.group, options.ranks) if options.ranks > 1 else None

    # --- WSGI ---------------------------------------------------------------------

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        method = environ["REQUEST_METHOD"]
        if self.o.loading:
            return self._json(start_response, "503 Service Unavailable", _error("Loading model", 503))
        if path == "/health":
            if self.gathering is not None and not self.gathering.complete:
                return self._json(start_response, "503 Service Unavailable", _error(self.gathering.waiting(), 503))
            if self._failing():
                return self._json(start_response, "500 Internal Server Error", _error("simulated failure", 500))
            return self._send(start_response, "200 OK", b"", "text/plain")
        if not self._authorised(environ):
            return self._json(start_response, "401 Unauthorized", _error("Invalid API Key", 401))
        if path == "/metrics":
            self.scrapes += 1
            return self._send(start_response, "200 OK", self.metrics_text().encode(), "text/plain; version=0.0.4")
        if path == "/tokenize":
            return self._tokenize(start_response, environ)
        if path == "/v1/models":
            model = {"id": self.o.model, "object": "model", "owned_by": "sim"}
            if self.o.max_context:
                model["max_model_len"] = self.o.max_context  # as vLLM says it
            body = {"object": "list", "data": [model]}
            return self._json(start_response, "200 OK", body)
        kinds = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
        if path not in kinds or method != "POST":
            return self._json(start_response, "404 Not Found", _error(f"no route {method} {path}", 404))
        try:
            body = json.loads(environ["wsgi.input"].read())
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            return self._json(start_response, "400 Bad Request", _error("body is not a JSON object", 400))
        if body.get("model") != self.o.model:
            return self._json(start_response, "404 Not Found",
                              _error(f"The model `{body.get('model')}` does not exist.", 404))
        self.requests += 1
        number = self.requests
        broken = self.gathering.waiting() if self.gathering is not None else None
        if broken:
            return self._json(start_response, "500 Internal Server Error", _error(broken, 500))
        if self._failing():
            return self._json(start_response, "500 Internal Server Error", _error("simulated failure", 500))
        kind = kinds[path]
        # Only llama.cpp's chat route reads tools and messages; its completions route leaves them be.
        choked = _choke(body) if kind == "chat" else None
        if choked:
            return self._json(start_response, "500 Internal Server Error", _error(choked, 500))
        if self.slots is not None and 0 <= self.o.max_queue <= self.waiting and self.slots.locked():
            start_response("429 Too Many Requests", [("Content-Type", "application/json"), ("Retry-After", "2")])
            return [json.dumps(_error("the queue is full", 429)).encode()]
        if kind == "embeddings":
            return self._json(start_response, "200 OK", self._embeddings(body))
        return self._generate(start_response, kind, body, number)

    def _failing(self) -> bool:
        return bool(self.o.fail_rate) and self.rng.random() < self.o.fail_rate

    def _authorised(self, environ) -> bool:
        if self.o.api_key is None:
            return True
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        return hmac.compare_digest(given, b"Bearer " + self.o.api_key.encode())

    @staticmethod
    def _send(start_response, status, data: bytes, ctype: str):
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(data)))])
        return [data]

    def _json(self, start_response, status, obj):
        return self._send(start_response, status, json.dumps(obj).encode(), "application/json")

    def _tokenize(self, start_response, environ):
        """llama.cpp's `POST /tokenize`: CONTENT, a text or a list of texts and token ids, as one run of
        tokens; the sim adds no special tokens."""
        try:
            content = json.loads(environ["wsgi.input"].read())["content"]
        except (ValueError, KeyError, TypeError):
            return self._json(start_response, "400 Bad Request", _error("content is required", 400))
        tokens = []
        for item in content if isinstance(content, list) else [content]:
            tokens += [item] if isinstance(item, int) else [_word_id(w) for w in str(item).split()]
        return self._json(start_response, "200 OK", {"tokens": tokens})

    # --- generation ---------------------------------------------------------------

    @staticmethod
    def _prompts(kind: str, body: dict) -> list[str]:
        """The prompts of a request: one for a chat, one per item of a completions prompt list."""
        if kind == "chat":
            return ["\n".join(m.get("content") if isinstance(m.get("content"), str) else ""
                               for m in body.get("messages") or [] if isinstance(m, dict))]
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return prompt
        return [prompt if isinstance(prompt, str) else json.dumps(prompt)]

    def _first_token_wait(self, tokens: list[str]) -> None:
        """Wait for TOKENS' first token: the fixed time, then the prefill of what the cache lacks."""
        ttft = self.o.ttft_ms / 1000
        if self.o.gather:
            self.gathered.wait(ttft)
        else:
            gevent.sleep(ttft)
        # Looked up once this request's turn to prefill comes, as an engine schedules it: a turn queued
        # behind its own conversation's previous one finds that one's blocks.
        with self.prefilling:
            cached = self.cache.cached(tokens)
            self.cache_queries += len(tokens)
            self.cache_hits += cached
            if self.o.prefill_ms_per_token:
                gevent.sleep((len(tokens) - cached) * self.o.prefill_ms_per_token / 1000)
            self.cache.keep(tokens)

    def _awaiting_first_token(self, tokens: list[str]):
        """Wait for TOKENS' first token, a stream's comment event every `keepalive_ms` meanwhile (llama.cpp's
        server sends `:` lines every 30 s while it reads a long prompt: the headers and those come long
        before any answer)."""
        if not self.o.keepalive_ms:
            self._first_token_wait(tokens)
            return
        waiting = gevent.spawn(self._first_token_wait, tokens)
        while not waiting.ready():
            waiting.join(self.o.keepalive_ms / 1000)
            if not waiting.ready():
                yield b": keep-alive\n\n"
        waiting.get()

    def _generate(self, start_response, kind: str, body: dict, number: int):
        prompts = self._prompts(kind, body)
        prompt = prompts[0]
        # Like llama.cpp: a task per prompt and choice, prompt by prompt, each reporting its own usage; a
        # whole answer's usage is the first task's. The engine's own counters know them all.
        tasks = [max(1, len(p.split())) for p in prompts for _ in range(body.get("n") or 1)]
        prompt_tokens = tasks[0]
        all_prompt_tokens = sum(max(1, len(p.split())) for p in prompts)
        if self.o.max_context and max(tasks) > self.o.max_context:
            return self._json(start_response, "400 Bad Request", _error(
                f"the request exceeds the available context size, try increasing it ({max(tasks)} tokens, "
                f"{self.o.max_context} allowed)", 400))
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        pieces, finish = self._answer(kind, body, limit, prompt)
        if kind == "chat" and self.o.reasoning is not None:
            pieces = [("reasoning", p) for p in _pieces(self.o.reasoning)] + pieces
        n_tokens = len(pieces)
        tokens = prompt.split()
        # What a client sends back as the assistant's message next turn, so the cache keeps it with the prompt.
        answered = tokens + "".join(p for p in pieces if isinstance(p, str)).split()
        reply = _Reply(kind, self.o.model, f"sim-{self.o.replica}", pieces, finish, tasks)
        if body.get("stream"):
            start_response("200 OK", [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")])
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self._events(reply, include_usage, tokens, answered, all_prompt_tokens, number)
        self._admit()
        try:
            self._first_token_wait(tokens)
            for _ in range(n_tokens - 1):
                self._token_delay()
            self.prompt_tokens += all_prompt_tokens
            self.generation_tokens += n_tokens * len(tasks)
            self.cache.keep(answered)
        finally:
            self._leave()
        if self.o.die_after and number >= self.o.die_after:
            os._exit(3)
        if self.o.garbled:
            return self._send(start_response, "200 OK", b"<html>502 Bad Gateway</html>", "text/html")
        return self._json(start_response, "200 OK", reply.whole(prompt_tokens))

    def _events(self, reply: "_Reply", include_usage: bool, tokens: list[str], answered: list[str],
                all_prompt_tokens: int, number: int):
        """A stream's events, generated as the engine would, each task's tokens in turn."""
        n_tokens, tasks = len(reply.pieces), len(reply.tasks)
        self._admit()
        try:
            yield from self._awaiting_first_token(tokens)
            self.prompt_tokens += all_prompt_tokens
            for i in range(n_tokens):
                if i:
                    self._token_delay()
                if i == self.o.stall_after_tokens:
                    gevent.sleep(3600)
                if self.o.die_after and number >= self.o.die_after and i >= n_tokens // 2:
                    os._exit(3)
                for j in range(tasks):
                    yield reply.chunk(i, index=j)
                    self.generation_tokens += 1
                if self.o.garbled:
                    yield b'data: {"error": {"message": "simulated failure mid-answer", "code": 500}}\n\n'
                    yield b"data: [DONE]\n\n"
                    return
            self.cache.keep(answered)
            for j in range(tasks):
                yield reply.final(j, include_usage)
            yield b"data: [DONE]\n\n"
        except GeneratorExit:
            self.cancelled += 1
            raise
        finally:
            self._leave()

    def _admit(self) -> None:
        self.held_peak = max(self.held_peak, self.running + self.waiting + 1)
        if self.slots is not None:
            self.waiting += 1
            try:
                self.slots.acquire()
            finally:
                self.waiting -= 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        if self.o.gather and self.running >= self.o.gather:
            self.gathered.set()

    def _leave(self) -> None:
        self.running -= 1
        if self.slots is not None:
            self.slots.release()

    def _token_delay(self) -> None:
        if self.o.tokens_per_s > 0:
            gevent.sleep(1 / self.o.tokens_per_s)

    def _answer(self, kind: str, body: dict, limit: int | None, prompt: str) -> tuple[list, str]:
        """What to answer BODY with, one piece a token (texts, or a tool call's deltas), and why it ends.

        Unscripted: LIMIT tokens `tok0 tok1 ...` (`default_tokens` without
        one), ending `length`. A scripted text stops at LIMIT too, as an
        engine's would; a tool call is never cut, so a test always gets a call
        it can run.
        """
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)] if kind == "chat" else []
        if self.o.tool_calls and messages and messages[-1].get("role") == "tool":
            return _cut(_pieces("The tool said: " + _text(messages[-1].get("content"))), limit)
        if self.o.tool_calls and not any(m.get("role") == "tool" for m in messages):
            offered = _offered(body)
            for name, arguments in self.o.tool_calls:
                if name in offered:
                    return _call_pieces(name, arguments), "tool_calls"
        for word, text in self.o.reply_if:
            if word in prompt:
                return _cut(_pieces(text), limit)
        if self.o.reply is not None:
            return _cut(_pieces(self.o.reply), limit)
        return [f"tok{i} " for i in range(limit or self.o.default_tokens)], "length"

    def _embeddings(self, body: dict) -> dict:
        value = body.get("input")
        inputs = value if isinstance(value, list) else [value]
        data = []
        tokens = 0
        for i, item in enumerate(inputs):
            text = item if isinstance(item, str) else json.dumps(item)
            tokens += max(1, len(text.split()))
            digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
            vector = [(digest[j % len(digest)] - 127.5) / 127.5 for j in range(self.o.embedding_dims)]
            data.append({"object": "embedding", "index": i, "embedding": vector})
        self.prompt_tokens += tokens
        return {"object": "list", "model": self.o.model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # --- metrics ------------------------------------------------------------------

    def metrics_text(self) -> str:
        capacity = self.o.max_concurrency or 64
        label = f'{{model_name="{self.o.model}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{label} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{label} {self.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {min(1.0, self.running / capacity):.4f}",
            "# TYPE vllm:prompt_tokens_total counter", f"vllm:prompt_tokens_total{label} {self.prompt_tokens}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {self.generation_tokens}",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{label} {self.cache_queries}",
            "# TYPE vllm:prefix_cache_hits_total counter", f"vllm:prefix_cache_hits_total{label} {self.cache_hits}",
            "# TYPE llmgw_sim_requests_total counter", f"llmgw_sim_requests_total {self.requests}",
            "# TYPE llmgw_sim_scrapes_total counter", f"llmgw_sim_scrapes_total {self.scrapes}",
            "# TYPE llmgw_sim_cancelled_total counter", f"llmgw_sim_cancelled_total {self.cancelled}",
            "# TYPE llmgw_sim_running_peak gauge", f"llmgw_sim_running_peak {self.peak}",
            "# TYPE llmgw_sim_held_peak gauge", f"llmgw_sim_held_peak {self.held_peak}",
        ]
        return "\n".join(lines) + "\n"


class _Reply:
    """One answer's pieces (a token each: a text, a tool call's delta, or ("reasoning", text)), written as
    a whole answer or as a stream's events, with a task per prompt and choice as llama.cpp has them."""

    def __init__(self, kind: str, model: str, fingerprint: str, pieces: list, finish: str, tasks: list[int]):
        self.kind, self.model, self.fingerprint = kind, model, fingerprint
        self.pieces, self.finish, self.tasks = pieces, finish, tasks
        self.ident = f"sim-{os.urandom(6).hex()}"
        self.created = int(time.time())
        self.obj = "chat.completion" if kind == "chat" else "text_completion"

    def usage(self, prompt_tokens: int) -> dict:
        n = len(self.pieces)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

    def whole(self, prompt_tokens: int) -> dict:
        pieces = self.pieces
        said = [p for p in pieces if not isinstance(p, tuple)]
        if said and isinstance(said[0], dict):
            message = {"role": "assistant", "content": None, "tool_calls": [_whole_call(said)]}
        else:
            message = {"role": "assistant", "content": "".join(said)}
        if len(said) < len(pieces):
            message["reasoning_content"] = "".join(p[1] for p in pieces if isinstance(p, tuple))
        choices = [{"index": j, "message": message, "finish_reason": self.finish}
                   if self.kind == "chat" else {"index": j, "text": message["content"], "finish_reason": self.finish}
                   for j in range(len(self.tasks))]
        return {"id": self.ident, "object": self.obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, "usage": self.usage(prompt_tokens)}

    def chunk(self, i: int | None, finish: str | None = None, index: int = 0, **extra) -> bytes:
        piece = self.pieces[i] if i is not None else None
        if self.kind == "chat":
            if piece is None:
                delta = {}
            elif isinstance(piece, dict):
                delta = {"tool_calls": [piece]}
            elif isinstance(piece, tuple):
                delta = {"reasoning_content": piece[1]}
            else:
                delta = {"content": piece}
            if i == 0:
                delta["role"] = "assistant"
                # OpenAI's first delta of a call says there is no text; its fragments follow.
                if isinstance(piece, dict):
                    delta["content"] = None
            choice = {"index": index, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "finish_reason": finish}
        return _event({"id": self.ident, "object": self.obj + ".chunk" if self.kind == "chat" else self.obj,
                       "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
                       "choices": [choice], **extra})

    def final(self, index: int, include_usage: bool) -> bytes:
        """Task INDEX's last event(s): as llama.cpp, a completion's usage rides on it, a chat's follows."""
        if not include_usage:
            return self.chunk(None, self.finish, index=index)
        usage = self.usage(self.tasks[index])
        if self.kind == "chat":
            return self.chunk(None, self.finish, index=index) + _event({
                "id": self.ident, "object": self.obj + ".chunk", "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [], "usage": usage})
        return self.chunk(None, self.finish, index=index, usage=usage)


class PrefixCache:
    """A replica's prefix cache: whole blocks of BLOCK_TOKENS tokens, at most CAPACITY tokens of them.

    A block is named by a hash of its tokens and its predecessor's name, so a
    block matches only where everything before it matches too, as in vLLM.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity // BLOCK_TOKENS  # in blocks
        self.blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    @staticmethod
    def _names(tokens: list[str]) -> list[bytes]:
        names, name = [], b""
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            block = " ".join(tokens[start:start + BLOCK_TOKENS]).encode("utf-8", "surrogatepass")
            name = hashlib.blake2b(name + block, digest_size=8).digest()
            names.append(name)
        return names

    def cached(self, tokens: list[str]) -> int:
        """How many of TOKENS, from the first, the cache holds (a multiple of BLOCK_TOKENS)."""
        found = 0
        for name in self._names(tokens):
            if name not in self.blocks:
                break
            found += BLOCK_TOKENS
        return found

    def keep(self, tokens: list[str]) -> None:
        """Hold TOKENS' whole blocks as the most recently used, evicting the least recently used past capacity."""
        if not self.capacity:
            return
        # Head last, so it is the most recent: evicting from the tail first keeps a shorter prefix usable.
        for name in reversed(self._names(tokens)):
            self.blocks[name] = None
            self.blocks.move_to_end(name)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def _pieces(text: str) -> list[str]:
    """TEXT as tokens: each word with the spaces before it, the last with those after it too."""
    pieces = re.findall(r"\s*\S+", text)
    tail = text[len("".join(pieces)):]
    if tail or not pieces:
        pieces[-1:] = [(pieces[-1] if pieces else "") + tail]
    return pieces


def _cut(pieces: list[str], limit: int | None) -> tuple[list[str], str]:
    if limit and len(pieces) > limit:
        return pieces[:limit], "length"
    return pieces, "stop"


def _text(content) -> str:
    """A message's text: itself, or its text parts joined."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else json.dumps(content)


def _offered(body: dict) -> set[str]:
    """The names of the functions BODY lets the model call (none under `tool_choice: "none"`)."""
    if body.get("tool_choice") == "none":
        return set()
    return {t["function"]["name"] for t in body.get("tools") or []
            if isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)}


def _call_pieces(name: str, arguments: str) -> list[dict]:
    """A call of NAME as stream deltas: the first names it with empty arguments, the rest carry them."""
    first = {"index": 0, "id": "call_" + os.urandom(12).hex(), "type": "function",
             "function": {"name": name, "arguments": ""}}
    return [first] + [{"index": 0, "function": {"arguments": arguments[i:i + ARGUMENT_FRAGMENT]}}
                      for i in range(0, len(arguments), ARGUMENT_FRAGMENT)]


def _whole_call(pieces: list[dict]) -> dict:
    first = pieces[0]
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    return {"id": first["id"], "type": "function", "function": {"name": first["function"]["name"],
                                                                "arguments": arguments}}


def _word_id(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=3).digest(), "big")


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _error(message: str, code: int) -> dict:
    kind = "invalid_request_error" if code < 500 else "unavailable_error" if code == 503 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _choke(body: dict) -> str | None:
    """What llama.cpp answers 500 for in BODY (its JSON library's words, echoing the request), or None.

    These are the request's fault, yet llama.cpp says 500: the inputs a fuzz
    of the real engine found (tools that are not a list, a message name that
    is an object, a text part without text).
    """
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return f"[json.exception.type_error.302] type must be array, but is {type(tools).__name__}: {tools!r}"
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        if "name" in message and not isinstance(message["name"], str):
            return f"[json.exception.type_error.302] type must be string, but is object: {message['name']!r}"
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "text"
                                             and not isinstance(p.get("text"), str) for p in content):
            return "[json.exception.out_of_range.403] key 'text' not found"
    return None


class _NoDelayServer(WSGIServer):
    # Without TCP_NODELAY, small writes wait for the previous one's ACK and the
    # median latency on loopback is about 44 ms instead of well under one.
    def handle(self, sock, address):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        return super().handle(sock, address)


def serve(listen: str, options: SimOptions, announce=print) -> None:
    """Serve a simulated engine on LISTEN (`HOST:PORT`; port 0 picks one) until killed; a rank above 0 of a
    replica over several nodes serves nothing, and only joins its rank 0."""
    if options.rank > 0:
        simranks.follow(options.master, options.group, options.rank, announce)
        return
    raise_fd_limit()
    engine = SimEngine(options)
    if engine.gathering is not None:
        engine.gathering.serve(options.master)
    server = _NoDelayServer(addresses.bind(listen, "--listen", free_port=True), engine, log=None, error_log=None,
                            backlog=4096)
    server.init_socket()
    bound_host, bound_port = server.socket.getsockname()[:2]
    announce(f"llmgw sim: {options.model} on http://{bound_host}:{bound_port}")
    server.serve_forever()
