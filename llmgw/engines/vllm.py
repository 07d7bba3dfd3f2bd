"""vLLM: whether it is installed, and how its load reads from `/metrics`.

Only a `vllm` the node's configuration names (`agent.vllm`) or one the node
installed into a virtual environment of its own is run; the PATH is never
searched (see llmgw/engines/llamacpp.py for why).

vLLM reports KV cache use as a fraction; the name changed in its V1 engine
(`kv_cache_usage_perc`), and older releases still in service say
`gpu_cache_usage_perc`. Both are read. The simulated engine uses these names.
"""

import subprocess

from llmgw import addresses


def probe(binary: str) -> str | None:
    """The version BINARY (a `vllm` named by the configuration) reports, or None when it does not run."""
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


def environment(host: str) -> dict[str, str]:
    """What vLLM is started with: no usage statistics (on by default, sent to vLLM's servers; DO_NOT_TRACK for
    the libraries it uses), and its internal sockets (ZeroMQ, gloo: about 13 of them) on HOST, the address
    gateways reach it at; without VLLM_HOST_IP they bind the machine's first non-loopback address."""
    found = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if host and host not in addresses.WILDCARDS:
        found["VLLM_HOST_IP"] = host
    return found


def command(source: str, name: str, host: str, port: int | None, gpus: list[int], max_context: int | None,
            args: list[str], binary: str | None = None, python: str | None = None, ranks=None) -> list[str]:
    """`vllm serve` as its documentation gives it: the model, the name clients use, where to listen,
    one tensor-parallel rank per GPU given, and prefix caching on (the gateway's prefix routing sends a
    conversation where its history is cached; a profile's `--no-enable-prefix-caching`, later, wins). BINARY:
    the `vllm` command; PYTHON: an interpreter that has vLLM (its command-line module is run, as the `vllm`
    script would: a script's first line names the directory it was installed in, which an install renames).
    RANKS (engines.Ranks): one node's engine of a replica over several nodes, in vLLM's own multi-node mode
    (`--distributed-executor-backend mp`, no Ray): tensor parallel over the node's GPUs, a pipeline stage a
    node (a profile's own `--pipeline-parallel-size`/`--tensor-parallel-size`, later, win: inside a
    multi-node NVLink domain, tensor parallel over every node's GPUs is the better split); rank 0 serves
    HTTP, the others run `--headless`. Every flag is checked against the `--help` of a real vLLM
    (tests/fixtures/vllm-0.32.0-serve-help.txt)."""
    if not (binary or python):
        raise RuntimeError("no vLLM on this node: name it with agent.vllm, or give the node an [[engines]] entry")
    program = [binary] if binary else [python, "-m", "vllm.entrypoints.cli.main"]
    argv = [*program, "serve", source, "--served-model-name", name]
    if port is not None:
        argv += ["--host", host, "--port", str(port)]
    if len(gpus) > 1:
        argv += ["--tensor-parallel-size", str(len(gpus))]
    if ranks is not None:
        master_host, master_port = addresses.parse(ranks.master, "master")
        argv += ["--distributed-executor-backend", "mp", "--pipeline-parallel-size", str(ranks.ranks),
                 "--nnodes", str(ranks.ranks), "--node-rank", str(ranks.rank), "--master-addr", master_host,
                 "--master-port", str(master_port)]
        if ranks.rank > 0:
            argv.append("--headless")
    if max_context:
        argv += ["--max-model-len", str(max_context)]
    return argv + ["--enable-prefix-caching"] + list(args)
