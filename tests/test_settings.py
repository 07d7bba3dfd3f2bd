import pytest

from llmgw import settings
from llmgw.settings import ConfigError


def write(tmp_path, text):
    path = tmp_path / "llmgw.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_a_file(monkeypatch):
    monkeypatch.delenv("LLMGW_CONFIG", raising=False)
    cfg = settings.load()
    assert cfg["gateway.listen"] == ":8080"
    assert cfg["gateway.max_body_bytes"] == 32 * 1024 * 1024
    assert cfg.endpoints == [] and cfg.models == []


def test_file_values_and_flag_overrides(tmp_path):
    path = write(tmp_path, '[gateway]\nlisten = "127.0.0.1:9000"\nworkers = 4\n[timeouts]\nidle = 5\n')
    cfg = settings.load(path, {"gateway.workers": 8, "gateway.listen": None})
    assert cfg["gateway.listen"] == "127.0.0.1:9000"  # a flag not given leaves the file's value
    assert cfg["gateway.workers"] == 8  # a flag given wins over the file
    assert cfg["timeouts.idle"] == 5.0 and isinstance(cfg["timeouts.idle"], float)


def test_config_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_CONFIG", write(tmp_path, "[gateway]\nworkers = 3\n"))
    assert settings.load()["gateway.workers"] == 3


@pytest.mark.parametrize("text, words", [
    ("[gateway]\nworkers = \"two\"\n", ["gateway.workers", "llmgw.toml", "expected int"]),
    ("[gateway]\nworkers = true\n", ["gateway.workers", "boolean"]),
    ("[gateway]\nworkers = 0\n", ["gateway.workers", "smallest allowed, 1"]),
    ("[gateway]\nlisen = \":80\"\n", ["gateway.lisen", "is not a setting", "gateway.listen"]),
    ("[gateway]\ntrusted_proxies = [\"not-an-ip\"]\n", ["trusted_proxies", "not an address"]),
    ("[log]\nlevel = \"loud\"\n", ["log.level", "debug, info"]),
    ("[routing]\npolicy = \"random\"\n", ["routing.policy", "prefix, least-load, round-robin"]),
    ("gateway = 3\n", ["gateway", "expected a table"]),
    ("[gateway\n", ["not valid TOML"]),
    ("[[endpoints]]\nid = \"a\"\nurl = \"ftp://x\"\nmodels = [\"m\"]\n", ["endpoint a", "http://"]),
    ("[[endpoints]]\nid = \"a\"\nurl = \"http://x\"\n", ["endpoints", "models is required"]),
    ("[[endpoints]]\nid = \"a\"\nurl = \"http://x\"\nmodels = [\"m\"]\n[[endpoints]]\nid = \"a\"\n"
     "url = \"http://y\"\nmodels = [\"m\"]\n", ["two endpoints have this id"]),
    ("[[models]]\nname = \"m\"\ncolour = \"red\"\n", ["unknown key 'colour'"]),
    ("[[models]]\nname = \"m\"\nrouting_profile = \"a b\"\n", ["model m", "routing_profile names"]),
    ("[[routing_profiles]]\nname = \"batch\"\npolicy = \"random\"\n", ["routing profile batch", "least-load"]),
    ("[[routing_profiles]]\nname = \"batch\"\ntotal = 0\n", ["total must be at least", "timeouts.total"]),
    ("[[routing_profiles]]\nname = \"batch\"\ncolour = 1\n", ["unknown key 'colour'", "affinity_factor"]),
    ("[[routing_profiles]]\nname = \"b\"\n[[routing_profiles]]\nname = \"b\"\n", ["b is declared twice"]),
    ("[[routing_profiles]]\nname = \"../b\"\n", ["1-64 letters"]),
    ("[routing]\ndefault_profile = \"batch\"\n", ["routing.default_profile", "no [[routing_profiles]] entry",
                                                    "there are: none"]),
])
def test_errors_name_the_key_the_file_and_what_is_allowed(tmp_path, text, words):
    with pytest.raises(ConfigError) as e:
        settings.load(write(tmp_path, text))
    for word in words:
        assert word in str(e.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the configuration file .*nope.toml"):
        settings.load(str(tmp_path / "nope.toml"))


def test_secret_from_a_file(tmp_path):
    secret = tmp_path / "dsn"
    secret.write_text("postgresql://gw:s3cret@db/llmgw\n")
    cfg = settings.load(write(tmp_path, f'[store]\nurl = "@{secret}"\n'))
    assert cfg["store.url"] == "postgresql+psycopg2://gw:s3cret@db/llmgw"


def test_secret_file_missing_is_named(tmp_path):
    with pytest.raises(ConfigError, match="store.url .* cannot read the secret file /nonexistent/dsn"):
        settings.load(write(tmp_path, '[store]\nurl = "@/nonexistent/dsn"\n'))


def test_endpoint_flags_add_to_the_file(tmp_path):
    path = write(tmp_path, '[[endpoints]]\nid = "a"\nurl = "http://127.0.0.1:1"\nmodels = ["m"]\nweight = 2\n')
    cfg = settings.load(path, endpoints=["b=http://127.0.0.1:2=m,n"])
    assert [e["id"] for e in cfg.endpoints] == ["a", "b"]
    assert cfg.endpoints[1]["models"] == ["m", "n"]
    assert cfg.endpoints[0]["weight"] == 2


@pytest.mark.parametrize("flag", ["nourl", "a=http://x", "=http://x=m", "a=http://x="])
def test_bad_endpoint_flag(flag):
    with pytest.raises(ConfigError, match="expected ID=URL=MODEL"):
        settings.load(endpoints=[flag])


def test_every_setting_has_help_and_a_default_of_its_type():
    for s in settings.SETTINGS:
        assert s.help.endswith((".", ")")), s.name
        assert settings.coerce(s.name, s.default, "defaults") == s.default


def test_reference_document_is_generated_from_the_settings():
    with open("docs/reference.md", encoding="utf-8") as f:
        assert f.read() == settings.reference_markdown(), "docs/reference.md is stale: run `make docs`"


def test_a_relative_path_in_a_file_is_relative_to_the_file(tmp_path, monkeypatch):
    # Read from another directory, `--config var/up.toml` once meant another, empty store.
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "db.secret").write_text("sqlite:///elsewhere.db")
    (tmp_path / "conf" / "llmgw.toml").write_text(
        '[store]\nurl = "sqlite:///data/llmgw.db"\n[controller]\nkeys_dir = "keys"\n'
        '[agent]\nwork_dir = "/srv/agent"\nweights_dir = "../weights"\n'
        '[mirror]\ndir = "models"\n[gateway]\nlisten = "127.0.0.1:8080"\n')
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "conf"
    cfg = settings.load("conf/llmgw.toml")
    assert cfg["store.url"] == f"sqlite:///{conf}/data/llmgw.db"
    assert (cfg["controller.keys_dir"], cfg["mirror.dir"]) == (f"{conf}/keys", f"{conf}/models")
    assert (cfg["agent.work_dir"], cfg["agent.weights_dir"]) == ("/srv/agent", f"{conf}/../weights")
    assert cfg.written["store.url"] == f"sqlite:///{conf}/data/llmgw.db"  # what `llmgw up` writes on
    assert cfg["gateway.listen"] == "127.0.0.1:8080"  # not a path
    # A secret's file too; defaults and flags stay relative to the working directory.
    (conf / "llmgw.toml").write_text('[store]\nurl = "@db.secret"\n')
    assert settings.load("conf/llmgw.toml")["store.url"] == "sqlite:///elsewhere.db"
    cfg = settings.load("conf/llmgw.toml", {"mirror.dir": "flagged"})
    assert (cfg["mirror.dir"], cfg["controller.keys_dir"]) == ("flagged", "var/keys")
    for url in ("sqlite:///:memory:", "sqlite://", "sqlite:////abs.db", "postgresql://h/db"):
        assert settings.absolute_store_url(url, "/base") == url


def test_a_commands_bare_name_stays_a_name_and_the_files_directory_must_be_its_owners(tmp_path, monkeypatch):
    from llmgw import filemodes

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "agent.toml").write_text('[agent]\nnvidia_smi = "nvidia-smi"\nllama_server = "bin/llama-server"\n')
    monkeypatch.chdir(tmp_path)
    cfg = settings.load("conf/agent.toml")
    assert (cfg["agent.nvidia_smi"], cfg["agent.llama_server"]) == ("nvidia-smi", f"{conf}/bin/llama-server")
    # Its relative paths are its directory's: a directory others may write is refused, as the file would be.
    conf.chmod(0o777)
    with pytest.raises(filemodes.LooseFiles, match=f"chmod go-w {conf}"):
        filemodes.check_roles(cfg, "agent")


def test_a_routing_profile_is_the_settings_with_its_own_values_over_them(tmp_path):
    from llmgw.gateway.routingprofiles import RoutingProfiles

    cfg = settings.load(write(tmp_path, '[routing]\ndefault_profile = "chat"\nattempts = 4\n[timeouts]\ntotal = 100\n'
                                        '[[routing_profiles]]\nname = "chat"\n'
                                        '[[routing_profiles]]\nname = "batch"\npolicy = "least-load"\ntotal = 3600\n'))
    profiles = RoutingProfiles(cfg)
    batch = profiles.of("batch", "chat")
    assert (batch.name, batch.policy, batch.total, batch.attempts) == ("batch", "least-load", 3600.0, 4)
    assert profiles.of(None, None).name == "chat" and profiles.of(None, None).policy == "prefix"
    assert profiles.of(None, "batch").name == "batch" and profiles.of("nowhere", None).name == "chat"
