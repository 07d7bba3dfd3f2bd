"""SGLang: whether it is installed, and how its load reads from `/metrics` (served with `--enable-metrics`).

`token_usage` is the fraction of the KV pool in use.
"""

import importlib.metadata
import importlib.util


def probe() -> str | None:
    """SGLang's version when this Python can import it, else None."""
    if importlib.util.find_spec("sglang") is None:
        return None
    return importlib.metadata.version("sglang")


LOAD_METRICS = {
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_cache",
}
