"""llama.cpp: launching its server and reading its load.

A `llama-server` binary is used where one is installed (what production nodes
run: a release build with every CPU and GPU backend). Otherwise the server
from the `xllamacpp` wheel, llama.cpp's own server code prebuilt for Python,
runs in a process of its own through `llmgw.engines.xllamacpp_server`, so a
machine with nothing but PyPI can serve a model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys

LOAD_METRICS = {
    "llamacpp:requests_deferred": "waiting",
    "llamacpp:requests_processing": "running",
    # Only older builds report this; newer ones leave KV use unknown.
    "llamacpp:kv_cache_usage_ratio": "kv_cache",
}


def find_binary() -> str | None:
    return shutil.which("llama-server")


def have_wheel() -> bool:
    return importlib.util.find_spec("xllamacpp") is not None


def probe() -> str | None:
    """The installed llama.cpp server's version, or None when there is none that runs."""
    binary = find_binary()
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
            parallel: int = 4, host: str = "127.0.0.1", binary: str | None = None) -> list[str]:
    """The command that serves MODEL_PATH as NAME on HOST:PORT, with `/metrics`, embeddings and tool calls on.

    Embeddings use mean pooling: llama.cpp refuses OpenAI-style embeddings
    from a chat model with its default pooling ("none"). Tool calls need the
    model's own Jinja chat template (`--jinja`): without it, a build whose
    default is off answers a chat with `tools` 500 ("tools param requires
    --jinja flag"), and the gateway translates other APIs' tools into such
    chats. A profile's `--no-jinja`, coming later, turns it off again, for a
    model whose template llama.cpp cannot read.
    """
    threads = threads or max(1, os.cpu_count() or 1)
    binary = binary if binary is not None else find_binary()
    if binary:
        return [binary, "--model", model_path, "--alias", name, "--host", host, "--port", str(port),
                "--ctx-size", str(ctx_size), "--threads", str(threads), "--parallel", str(parallel),
                "--metrics", "--embeddings", "--pooling", "mean", "--jinja", "--no-webui"]
    if not have_wheel():
        raise RuntimeError("no llama.cpp server here: install llama.cpp's `llama-server`, "
                           "or the wheel with `pip install xllamacpp`")
    return [sys.executable, "-m", "llmgw.engines.xllamacpp_server", "--model", model_path, "--alias", name,
            "--host", host, "--port", str(port), "--ctx-size", str(ctx_size), "--threads", str(threads),
            "--parallel", str(parallel), "--jinja"]
