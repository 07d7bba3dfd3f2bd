"""Run llama.cpp's server from the `xllamacpp` wheel as a process of its own.

    python -m llmgw.engines.xllamacpp_server --model FILE.gguf --alias NAME --port 8001

The flags are `llama-server`'s names for the same settings, so the engine
module builds one command line for either; like `llama-server`, it takes its
API key from `LLAMA_API_KEY` in the environment (then it answers only requests
that carry the key, `/health` excepted). The server runs on llama.cpp's own
threads; this process only waits for a signal to stop.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--alias", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ctx-size", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=4)
    # The model's own chat template, which parses tool calls; the last of --jinja and --no-jinja wins.
    # A request's own sampling fields win; these are the defaults for the fields it leaves out.
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--temp", type=float, default=0.8)
    parser.add_argument("--repeat-penalty", type=float, default=1.0)
    parser.add_argument("--jinja", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    # A set: a plain string here becomes one alias per letter.
    params.model_alias = {args.alias}
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx_size
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.n_parallel = args.parallel
    params.endpoint_metrics = True
    params.embedding = True
    params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
    params.use_jinja = args.jinja
    params.sampling.top_k = args.top_k
    params.sampling.top_p = args.top_p
    params.sampling.temp = args.temp
    params.sampling.penalty_repeat = args.repeat_penalty
    if os.environ.get("LLAMA_API_KEY"):
        params.api_keys = [os.environ["LLAMA_API_KEY"]]
    # Blocked before llama.cpp starts its threads, which inherit the mask, and taken by this thread alone.
    # Handled with signal.pause(), a SIGTERM sent to an engine that was stopped (SIGSTOP, then SIGCONT: how
    # a hung one is restarted) went to whichever llama.cpp thread ran first, and the pause never ended.
    stopping = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
    server = xllamacpp.Server(params)
    print(f"llama.cpp (xllamacpp) serving {args.alias} on {server.listening_address}", flush=True)
    signal.sigwait(stopping)
    return 0


if __name__ == "__main__":
    sys.exit(main())
