"""vLLM: how its load reads from `/metrics`.

vLLM reports KV cache use as a fraction; the name changed in its V1 engine
(`kv_cache_usage_perc`), and older releases still in service say
`gpu_cache_usage_perc`. Both are read. The simulated engine uses these names.
"""

LOAD_METRICS = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache",
    "vllm:gpu_cache_usage_perc": "kv_cache",
}
