"""SGLang: how its load reads from `/metrics` (served with `--enable-metrics`).

`token_usage` is the fraction of the KV pool in use.
"""

LOAD_METRICS = {
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_cache",
}
