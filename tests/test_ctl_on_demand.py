"""`llmgw ctl model add` says what will happen to the model it added, against a real controller: a model with
replicas to keep starts now; an on-demand one (scaling.min = 0) starts only at its first request, and ctl
said "shows it starting" for it too, sending operators to look for a replica that was never coming."""

import re

import pytest

from tests.cluster import Controller


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    c = Controller(tmp_path_factory.mktemp("ctl-on-demand"))
    yield c
    c.stop()


def add(controller, tmp_path, name: str, scaling: str):
    model = tmp_path / f"{name}.toml"
    model.write_text(f'name = "{name}"\nsource = "/dev/null"\nscaling = {scaling}\n'
                     '[[profiles]]\nengine = "sim"\n')
    return controller.ctl("model", "add", "-f", str(model))


def test_an_on_demand_model_is_said_to_start_at_its_first_request(controller, tmp_path):
    added = add(controller, tmp_path, "lazy", '{min = 0, max = 1, idle_timeout = "30m"}')
    assert added.returncode == 0, added.stderr
    said = " ".join(added.stderr.split())
    assert "starting" not in said
    assert "on demand (scaling.min = 0): nothing starts now" in said and "The first request for it starts" in said
    assert re.search(r"waits up to gateway\.load_wait \(120 s in this configuration\) and then gets 503", said)
    assert "stops after 30 minutes without requests" in said and "llmgw ctl scale lazy --min 1" in said
    assert controller.replicas("lazy") == []  # and indeed nothing started


def test_an_on_demand_model_without_an_idle_timeout_names_the_default(controller, tmp_path):
    said = " ".join(add(controller, tmp_path, "lazier", "{min = 0, max = 1}").stderr.split())
    assert "stops after 15 minutes without requests" in said


def test_a_model_with_replicas_to_keep_is_said_to_be_starting(controller, tmp_path):
    added = add(controller, tmp_path, "eager", "{min = 1, max = 1}")
    assert added.returncode == 0 and "`llmgw ctl replicas --model eager` shows it starting" in added.stderr
