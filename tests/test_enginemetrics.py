import os

import pytest

from llmgw.engines.metrics import parse_load

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def fixture(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


@pytest.mark.parametrize("name, expected", [
    # Captured from llama.cpp's server (xllamacpp) with one slot busy and two requests queued.
    ("llamacpp-metrics.txt", {"running": 1.0, "waiting": 2.0}),
    ("vllm-metrics.txt", {"running": 3.0, "waiting": 2.0, "kv_cache": 0.25}),
    ("vllm-old-metrics.txt", {"running": 1.0, "waiting": 0.0, "kv_cache": 0.5}),
    ("sglang-metrics.txt", {"running": 4.0, "waiting": 0.0, "kv_cache": 0.71}),
])
def test_engine_load_figures(name, expected):
    assert parse_load(fixture(name)) == expected


def test_absent_figures_stay_absent():
    assert parse_load("# nothing here\nprocess_cpu_seconds_total 3.2\n") == {}
    assert parse_load('vllm:num_requests_running{model_name="m"} NaN\n') == {}
    assert parse_load("vllm:num_requests_running{model_name=\"m\"} notanumber\n") == {}


def test_counts_sum_over_label_sets():
    text = 'vllm:num_requests_running{model_name="a"} 2.0\nvllm:num_requests_running{model_name="b"} 3.0\n'
    assert parse_load(text) == {"running": 5.0}


def test_longer_names_with_the_same_start_are_not_confused():
    assert parse_load("vllm:num_requests_running_total 9\nvllm:num_requests_waiting_by_reason 4\n") == {}


def test_figures_the_controller_would_refuse_are_left_out():
    # The controller drops a whole heartbeat with a figure that is not finite and non-negative.
    text = 'vllm:num_requests_running{model_name="m"} +Inf\nvllm:num_requests_waiting{model_name="m"} -1\n'
    assert parse_load(text) == {}
