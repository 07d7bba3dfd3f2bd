"""Model names and aliases: one rule, checked on every way into the catalog, agreeing with the gateways' bound."""

import json
import logging
import time

import pytest

from llmgw import modelnames, store
from llmgw.control import catalog
from llmgw.control.publisher import snapshot_body
from llmgw.wire import gateways


def table(name="m", **more) -> dict:
    return {"name": name, "source": "/m", "profiles": [{"engine": "sim"}], **more}


@pytest.mark.parametrize("name", ["qwen2.5-7b-instruct", "llama3.1:8b", "SmolLM2-135M-Instruct", "m", "a_b",
                                  "x" * modelnames.LONGEST])
def test_real_model_names_fit_the_rule(name):
    assert catalog.parse_model(table("other", aliases=[name])).aliases == (name,)
    assert catalog.parse_model(table(name)).name == name


@pytest.mark.parametrize("name", ["x" * 250, "x" * (modelnames.LONGEST + 1), "org/model", "a b", "bad\nname",
                                  "esc\x1b[31m", "del\x7f", ".hidden", "-rf", "ünïcode", "a?force=1", 7, ["m"]])
def test_a_name_outside_the_rule_is_refused_saying_the_rule(name):
    with pytest.raises(catalog.CatalogError) as e:
        catalog.parse_model(table(name))
    message = str(e.value)
    assert modelnames.RULE in message
    assert "\n" not in message and "\x1b" not in message and len(message) < 400  # the name shown inert, bounded


@pytest.mark.parametrize("aliases", [["ok", "org/alias"], ["bad\nalias"], ["x" * 250], [""],
                                     [f"a{i}" for i in range(modelnames.MOST_ALIASES + 1)], "not-a-list"])
def test_a_bad_alias_or_too_many_are_refused(aliases):
    with pytest.raises(catalog.CatalogError, match="alias"):
        catalog.parse_model(table(aliases=aliases))


def test_as_many_aliases_as_allowed_are_taken():
    aliases = [f"a{i}" for i in range(modelnames.MOST_ALIASES)]
    assert catalog.parse_model(table(aliases=aliases)).aliases == tuple(aliases)


def test_the_longest_model_the_catalog_takes_is_a_snapshot_every_gateway_reads():
    """A 250-character name once passed the catalog and made every gateway refuse every snapshot after it."""
    name = "x" * modelnames.LONGEST
    model = catalog.parse_model(table(name, aliases=[f"{i}" + "y" * (modelnames.LONGEST - 2)
                                                     for i in range(modelnames.MOST_ALIASES)]))
    body = snapshot_body({name: model}, [])
    gateways.decode(gateways.encode("snapshot", epoch="e", version=1, **body))
    too_long = {**body, "models": [{**body["models"][0], "name": name + "x"}]}
    with pytest.raises(gateways.ProtocolError):
        gateways.decode(gateways.encode("snapshot", epoch="e", version=1, **too_long))


def test_an_alias_may_not_be_another_models_name(tmp_path):
    cat = catalog.Catalog(store.open_store(f"sqlite:///{tmp_path}/s.db"), [table("first", aliases=["one"])])
    with pytest.raises(catalog.CatalogError, match="the alias first is the name of another model"):
        cat.add(table("second", aliases=["first"]))
    with pytest.raises(catalog.CatalogError, match="first has it as an alias"):
        cat.add(table("one"))
    cat.add(table("second", aliases=["two"]))
    cat.add(table("second", aliases=["two", "deux"]))  # replacing a model is no clash with itself


def test_a_stored_model_the_rule_refuses_is_skipped_and_logged_not_fatal(tmp_path, caplog):
    engine = store.open_store(f"sqlite:///{tmp_path}/s.db")
    bad = "x" * 250  # stored before names had a rule
    with store.writing(engine) as conn:
        for name in (bad, "good"):
            conn.execute(store.catalog_models.insert().values(name=name, spec=json.dumps(table(name)),
                                                              updated_at=time.time()))
    with caplog.at_level(logging.ERROR, logger="llmgw.control.catalog"):
        cat = catalog.Catalog(engine, [])
    assert set(cat.models()) == {"good"}
    assert "skipped the stored model" in caplog.text and "llmgw ctl model remove" in caplog.text
    cat.remove(bad)  # what the log line says to do works, although it was never loaded
    with engine.connect() as conn:
        assert [r.name for r in conn.execute(store.catalog_models.select())] == ["good"]
