"""llama.cpp: launching its server and reading its load.

A `llama-server` binary is used where one is given: named by the node's
configuration (`agent.llama_server`) or installed by the node from its engine
catalogue (a release build with every CPU and GPU backend). Otherwise the
server from the `xllamacpp` wheel, llama.cpp's own server code prebuilt for
Python, runs in a process of its own through `llmgw.engines.xllamacpp_server`:
from llmgw's own environment (the wheel is one of llmgw's dependencies), or
from a virtual environment the node installed it into. A `llama-server` that
merely lies on the PATH is never run, not even to ask its version: a wrapper
named like an engine would run with the agent's rights.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

LOAD_METRICS = {
    "llamacpp:requests_deferred": "waiting",
    "llamacpp:requests_processing": "running",
    # Only older builds report this; newer ones leave KV use unknown.
    "llamacpp:kv_cache_usage_ratio": "kv_cache",
}


CONTEXT = 4096  # tokens a request may use where the catalog names no max_context
SLOTS = 4  # requests llama.cpp runs at once where the profile's arguments do not say (--parallel)


def slots(args: list[str]) -> int:
    """The slots a profile's ARGS ask for (`--parallel N`, `-np N`, `--parallel=N`; the last wins, as it does
    for llama.cpp), else SLOTS."""
    found = SLOTS
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--parallel", "-np"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value.isdigit() and int(value) > 0:
                found = int(value)
    return found


# Run by a path, with `-I`, from an interpreter that may not have llmgw: it imports only the standard library and
# xllamacpp, and `-I` keeps this folder (whose module names are common ones) off that interpreter's path.
SERVER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xllamacpp_server.py")


def have_wheel() -> bool:
    return importlib.util.find_spec("xllamacpp") is not None


def probe(binary: str | None = None) -> str | None:
    """The version of BINARY (a `llama-server` llmgw installed or the configuration names), or of the
    xllamacpp wheel in llmgw's own environment (its metadata: nothing runs); None when there is none that runs."""
    if binary:
        try:
            run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        match = re.search(r"version: (\S+)", run.stdout + run.stderr)
        return match.group(1) if run.returncode == 0 and match else None
    if have_wheel():
        return "xllamacpp " + importlib.metadata.version("xllamacpp")
    return None


def command(model_path: str, port: int, name: str, ctx_size: int = 4096, threads: int | None = None,
            parallel: int = 4, host: str = "127.0.0.1", binary: str | None = None,
            python: str | None = None) -> list[str]:
    """The command that serves MODEL_PATH as NAME on HOST:PORT, with `/metrics`, embeddings and tool calls on.

    Embeddings use mean pooling: llama.cpp refuses OpenAI-style embeddings
    from a chat model with its default pooling ("none"). Tool calls need the
    model's own Jinja chat template (`--jinja`): without it, a build whose
    default is off answers a chat with `tools` 500 ("tools param requires
    --jinja flag"), and the gateway translates other APIs' tools into such
    chats. A profile's `--no-jinja`, coming later, turns it off again, for a
    model whose template llama.cpp cannot read.

    BINARY: a `llama-server` to run; PYTHON: an interpreter with the xllamacpp wheel (a virtual environment the
    node installed); neither: the wheel in llmgw's own environment.
    """
    threads = threads or max(1, os.cpu_count() or 1)
    if binary:
        return [binary, "--model", model_path, "--alias", name, "--host", host, "--port", str(port),
                "--ctx-size", str(ctx_size), "--threads", str(threads), "--parallel", str(parallel),
                "--metrics", "--embeddings", "--pooling", "mean", "--jinja", "--no-webui"]
    if python:
        return [python, "-I", SERVER_FILE, "--model", model_path, "--alias", name, "--host", host, "--port", str(port),
                "--ctx-size", str(ctx_size), "--threads", str(threads), "--parallel", str(parallel), "--jinja"]
    if not have_wheel():
        raise RuntimeError("no llama.cpp server here: install llama.cpp's `llama-server`, "
                           "or the wheel with `pip install xllamacpp`")
    return [sys.executable, "-m", "llmgw.engines.xllamacpp_server", "--model", model_path, "--alias", name,
            "--host", host, "--port", str(port), "--ctx-size", str(ctx_size), "--threads", str(threads),
            "--parallel", str(parallel), "--jinja"]
