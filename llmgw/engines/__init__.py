"""The engines llmgw runs, one module each: how to launch it and how to read its load.

`LOAD_METRICS` maps each engine's Prometheus names onto the three figures
routing uses (requests waiting, requests running, KV cache use from 0 to 1).
The gateway does not need to know which engine a replica runs: the names do
not overlap, so one table reads them all.
"""

from llmgw.engines import llamacpp, sglang, vllm

LOAD_METRICS: dict[str, str] = {**vllm.LOAD_METRICS, **llamacpp.LOAD_METRICS, **sglang.LOAD_METRICS}
