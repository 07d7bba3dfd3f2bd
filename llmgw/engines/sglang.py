"""SGLang: whether it is installed, and how its load reads from `/metrics` (served with `--enable-metrics`).

`token_usage` is the fraction of the KV pool in use.
"""

import importlib.metadata
import importlib.util
import sys


def probe() -> str | None:
    """SGLang's version when llmgw's own Python can import it (its metadata: nothing runs), else None."""
    if importlib.util.find_spec("sglang") is None:
        return None
    return importlib.metadata.version("sglang")


LOAD_METRICS = {
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_cache",
}


def command(source: str, name: str, host: str, port: int, gpus: list[int], max_context: int | None,
            args: list[str], api_key: str | None = None, python: str | None = None) -> list[str]:
    """SGLang's server as its documentation gives it, with metrics on (routing reads them). With API_KEY,
    it answers only requests that carry it: SGLang reads its key from this flag only. PYTHON: an interpreter
    that has SGLang (a virtual environment the node installed); else llmgw's own. Every flag is checked against
    SGLang 0.5.23's own parser (tests/fixtures/sglang-0.5.23-launch-server-help.txt): it has no CPU build, so it
    has never run here."""
    argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", source, "--served-model-name", name,
            "--host", host, "--port", str(port), "--enable-metrics"]
    if api_key:
        argv += ["--api-key", api_key]
    if len(gpus) > 1:
        argv += ["--tp-size", str(len(gpus))]
    if max_context:
        argv += ["--context-length", str(max_context)]
    return argv + list(args)
