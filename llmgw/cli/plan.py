"""`llmgw ctl plan MODEL`: does a model fit, where, and with what profile, before any node fetches it.

The model's shape is read where it lies, without fetching it: a GGUF file's
header (its first 64 KiB, by a Range request for a URL such as the mirror's),
or a Hugging Face folder's `config.json` and the size its safetensors index
gives. From the shape comes what one request's context holds in the KV cache
(two vectors, key and value, of each layer's key-value heads, in 16 bits, a
token), and so what a replica needs: its weights, the cache for its context,
and an allowance for the engine itself. Each node of the fleet (the
controller's list) is then held to it: on one card, on several of one node
(tensor parallel), on its memory without a card (llama.cpp only), or not at
all, and the profile to write is printed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import urllib.error
import urllib.parse
import urllib.request

from llmgw import gguf, shardsets
from llmgw.units import human_bytes

GiB = 1 << 30
ENGINE_ALLOWANCE = 1 * GiB  # the engine's own memory beside the weights and the cache: its runtime, buffers
CARD_SHARE = 0.9  # of a card's memory an engine is given (vLLM's --gpu-memory-utilization)
CONTEXT_MOST = 32768  # a planned context, where the model was trained for more and none is asked for
TENSOR_PARALLEL = (1, 2, 4, 8)  # vLLM splits attention heads evenly: a power of two


class PlanError(Exception):
    """The model's shape cannot be read; the message says why and what to give instead."""


@dataclasses.dataclass(frozen=True)
class Shape:
    source: str
    kind: str  # "gguf" (llama.cpp) or "safetensors" (vLLM, SGLang)
    architecture: str
    weights_bytes: int
    layers: int | None
    kv_heads: int | None
    head_dim: int | None
    trained_context: int | None

    def kv_bytes_per_token(self) -> int | None:
        """Key and value, of every layer's key-value heads, in 16 bits: what one token of context holds."""
        if not (self.layers and self.kv_heads and self.head_dim):
            return None
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def _read(source: str) -> bytes | None:
    """A small file (config.json, a safetensors index), a path or an http(s) URL; at most 4 MiB of it."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=30) as resp:
                return resp.read(4 << 20)
        except (urllib.error.URLError, OSError):
            return None
    try:
        with open(source, "rb") as f:
            return f.read(4 << 20)
    except OSError:
        return None


def _size(source: str) -> int | None:
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(urllib.request.Request(source, method="HEAD"), timeout=30) as resp:
                length = resp.headers.get("Content-Length")
                return int(length) if length and length.isdigit() else None
        except (urllib.error.URLError, OSError):
            return None
    try:
        return os.path.getsize(source)
    except OSError:
        return None


def _gguf_size(source: str) -> int | None:
    """A GGUF's size; for a shard of a split set (`-00001-of-00003.gguf`), every part's together."""
    parts = urllib.parse.urlsplit(source)
    folder, _, name = parts.path.rpartition("/")
    names = shardsets.siblings(name)
    if names is None:
        return _size(source)
    total = 0
    for part in names:  # the same address but for the file's name: a signed URL's query stays
        size = _size(urllib.parse.urlunsplit(parts._replace(path=f"{folder}/{part}")) if parts.scheme
                     else os.path.join(os.path.dirname(source), part))
        if size is None:
            return None
        total += size
    return total


def from_registry(source: str, endpoint: str) -> str:
    """A registry source, `hf:ORG/REPO[/FILE][@REVISION]`, as the address of that file (or, without one, of the
    repository's folder) at that revision (its main branch without one) on the Hugging Face compatible
    registry at ENDPOINT; any other source as it is."""
    if not source.startswith("hf:"):
        return source
    spec, _, revision = source[3:].partition("@")
    parts = spec.strip("/").split("/")
    if len(parts) < 2 or not all(parts) or ".." in parts:
        raise PlanError(f"{source} is not a registry source: write hf:ORG/REPO[/FILE][@REVISION]")
    quote = urllib.parse.quote
    address = f"{endpoint.rstrip('/')}/{quote(parts[0])}/{quote(parts[1])}/resolve/{quote(revision or 'main', safe='')}"
    return "/".join([address, *map(quote, parts[2:])])


def read_shape(source: str) -> Shape:
    """The shape of the model at SOURCE: a GGUF file, or a Hugging Face folder (a path or a URL); raises
    PlanError."""
    if urllib.parse.urlsplit(source).path.endswith(".gguf"):
        head = gguf.read_head(source)
        if head is None:
            raise PlanError(f"{source} cannot be read: give a path on this machine or an http(s) URL")
        try:
            found = gguf.shape(head)
        except gguf.NotGGUF as e:
            raise PlanError(f"{source} is not a GGUF file ({e}): give the model's .gguf file, or its Hugging Face "
                            "folder") from None
        size = _gguf_size(source)
        if size is None:
            raise PlanError(f"{source}'s size cannot be read (its server answered no Content-Length): give the file "
                            "by its path, or the mirror's URL of it")
        heads, width = found.get("head_count"), found.get("embedding_length")
        head_dim = found.get("key_length") or (width // heads if isinstance(width, int) and isinstance(heads, int)
                                               and heads else None)
        return Shape(source, "gguf", str(found["architecture"]), size, _int(found.get("block_count")),
                     _int(found.get("head_count_kv") or heads), _int(head_dim), _int(found.get("context_length")))
    base = source.rstrip("/")
    raw = _read(base + "/config.json")
    if raw is None:
        raise PlanError(f"no config.json at {base}: give a GGUF file, or a Hugging Face folder (a path or the "
                        "mirror's URL of a version)")
    try:
        config = json.loads(raw)
    except ValueError:
        raise PlanError(f"{base}/config.json is not JSON") from None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    index = _read(base + "/model.safetensors.index.json")
    size = None
    if index is not None:
        try:
            size = int(json.loads(index)["metadata"]["total_size"])
        except (ValueError, KeyError, TypeError):
            size = None
    size = size or _size(base + "/model.safetensors")
    if size is None:
        raise PlanError(f"the size of {base}'s weights cannot be read (no model.safetensors.index.json, no "
                        "model.safetensors)")
    heads = _int(config.get("num_attention_heads"))
    hidden = _int(config.get("hidden_size"))
    return Shape(source, "safetensors", str((config.get("architectures") or [config.get("model_type", "?")])[0]),
                 size, _int(config.get("num_hidden_layers")), _int(config.get("num_key_value_heads") or heads),
                 _int(config.get("head_dim") or (hidden // heads if hidden and heads else None)),
                 _int(config.get("max_position_embeddings")))


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def needed(shape: Shape, context: int) -> int:
    """Bytes a replica of SHAPE needs for one request of CONTEXT tokens at a time: weights, cache, engine."""
    per_token = shape.kv_bytes_per_token()
    cache = per_token * context if per_token else shape.weights_bytes // 4  # unknown shape: a quarter more
    return shape.weights_bytes + cache + ENGINE_ALLOWANCE


@dataclasses.dataclass(frozen=True)
class Fit:
    node: str
    fits: bool
    how: str  # in words
    profile: dict | None  # the [[profiles]] entry that would run it there


def fits(shape: Shape, need: int, node: dict) -> Fit:
    """Whether and how a replica needing NEED bytes runs on NODE (as `/api/v1/nodes` gives it)."""
    node_id = node.get("node_id", "?")
    cards = [g for g in (node.get("facts") or {}).get("gpus") or [] if isinstance(g, dict)
             and isinstance(g.get("memory_total_bytes"), int)]
    memory = ((node.get("status") or {}).get("memory") or (node.get("facts") or {}).get("memory") or {})
    ram = memory.get("total_bytes") if isinstance(memory.get("total_bytes"), int) else None
    engine = "llamacpp" if shape.kind == "gguf" else "vllm"
    if cards:
        card = min(g["memory_total_bytes"] for g in cards)
        gpu_class = cards[0].get("class") or cards[0].get("name") or "gpu"
        counts = range(1, len(cards) + 1) if engine == "llamacpp" else [n for n in TENSOR_PARALLEL if n <= len(cards)]
        for n in counts:
            if need <= n * card * CARD_SHARE:
                profile = {"engine": engine, "gpu_class": gpu_class, "gpus": n}
                on = "one card" if n == 1 else f"{n} cards"
                return Fit(node_id, True, f"on {on} of {human_bytes(card)} ({gpu_class})", profile)
        if engine == "vllm":
            return Fit(node_id, False, f"needs more than its {len(cards)} cards of {human_bytes(card)} hold: a "
                                       "replica over several nodes (`nodes` in the profile; docs/operations.md, "
                                       "\"Fabrics and multi-node models\")", None)
    if engine == "llamacpp" and ram is not None and need <= ram * CARD_SHARE:
        return Fit(node_id, True, f"on its CPUs, in {human_bytes(ram)} of memory (slowly: no card)",
                   {"engine": "llamacpp"})
    if engine == "vllm" and not cards:
        return Fit(node_id, False, "has no GPU: safetensors are served by vLLM or SGLang on GPUs (a GGUF "
                                   "of the model would run on its CPUs)", None)
    return Fit(node_id, False, f"has {human_bytes(ram) if ram else 'an unknown amount of'} memory", None)


def plan(shape: Shape, nodes: list[dict], context: int | None) -> dict:
    """The whole answer, as `--json` prints it."""
    chosen = context or min(shape.trained_context or CONTEXT_MOST, CONTEXT_MOST)
    need = needed(shape, chosen)
    return {"source": shape.source, "kind": shape.kind, "architecture": shape.architecture,
            "weights_bytes": shape.weights_bytes, "kv_bytes_per_token": shape.kv_bytes_per_token(),
            "trained_context": shape.trained_context, "context": chosen, "needed_bytes": need,
            "rough_bytes": math.ceil(shape.weights_bytes * 1.5) + 2 * GiB,
            "nodes": [dataclasses.asdict(fits(shape, need, n)) for n in nodes]}
