"""vLLM: whether it is installed, and how its load reads from `/metrics`.

vLLM reports KV cache use as a fraction; the name changed in its V1 engine
(`kv_cache_usage_perc`), and older releases still in service say
`gpu_cache_usage_perc`. Both are read. The simulated engine uses these names.
"""

import shutil
import subprocess


def probe() -> str | None:
    """The version of the `vllm` on the PATH, or None when there is none that runs."""
    binary = shutil.which("vllm")
    if not binary:
        return None
    try:
        run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = run.stdout.strip().splitlines()
    return lines[-1] if run.returncode == 0 and lines else None


LOAD_METRICS = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache",
    "vllm:gpu_cache_usage_perc": "kv_cache",
}


def command(source: str, name: str, host: str, port: int, gpus: list[int], max_context: int | None,
            args: list[str]) -> list[str]:
    """`vllm serve` as its documentation gives it: the model, the name clients use, where to listen,
    one tensor-parallel rank per GPU given."""
    argv = [shutil.which("vllm") or "vllm", "serve", source, "--served-model-name", name,
            "--host", host, "--port", str(port)]
    if len(gpus) > 1:
        argv += ["--tensor-parallel-size", str(len(gpus))]
    if max_context:
        argv += ["--max-model-len", str(max_context)]
    return argv + list(args)
