"""The rules of llmgw.addresses: one reading of HOST:PORT, and lists of addresses and networks."""

from __future__ import annotations

import pytest
import zmq

from llmgw import addresses, settings
from llmgw.addresses import AddressList


def test_an_empty_host_is_every_address_to_bind_and_loopback_to_dial():
    assert addresses.parse(":8080", "gateway.listen") == ("", 8080)
    assert addresses.bind(":8080", "gateway.listen") == ("0.0.0.0", 8080)
    assert addresses.dial(":8080", "gateway.listen") == "127.0.0.1:8080"
    assert addresses.dial("0.0.0.0:8080", "gateway.listen") == "127.0.0.1:8080"
    assert addresses.url(":8080", "gateway.listen") == "http://127.0.0.1:8080"
    assert addresses.zmq_bind(":7443", "controller.agent_listen") == "tcp://*:7443"
    assert addresses.zmq_bind("0.0.0.0:7443", "controller.agent_listen") == "tcp://*:7443"
    assert addresses.zmq_connect(":7443", "agent.controllers") == "tcp://127.0.0.1:7443"


def test_a_named_host_is_kept():
    assert addresses.bind("10.0.0.5:80", "s") == ("10.0.0.5", 80)
    assert addresses.dial("controller.internal:7443", "s") == "controller.internal:7443"
    assert addresses.zmq_bind("127.0.0.1:7444", "s") == "tcp://127.0.0.1:7444"


def test_ipv6_is_written_in_brackets():
    assert addresses.parse("[::1]:80", "s") == ("::1", 80)
    assert addresses.url("[::1]:80", "s") == "http://[::1]:80"
    assert addresses.zmq_connect("[fd00::5]:7443", "s") == "tcp://[fd00::5]:7443"
    # The IPv6 wildcard dials IPv6 loopback: with bindv6only it is not open to IPv4.
    assert addresses.dial("[::]:80", "s") == "[::1]:80"
    with pytest.raises(ValueError, match=r"gateway.listen .*in brackets, as in \[::1\]:80"):
        addresses.parse("::1:80", "gateway.listen")
    with pytest.raises(ValueError, match="gateway.listen .*IPv6 address as"):
        addresses.parse("[not-v6]:80", "gateway.listen")


@pytest.mark.parametrize("text", ["8080", "host", "host:", "host:http", "host:65536", "host:-1", ":8O80",
                                  "a b:80", "http://host:80", "[::1]80", ""])
def test_what_is_not_host_port_is_refused_with_the_setting_named(text):
    with pytest.raises(ValueError, match="^mirror.listen is "):
        addresses.parse(text, "mirror.listen")


def test_port_0_is_a_free_port_only_where_allowed():
    with pytest.raises(ValueError, match="port 0"):
        addresses.parse("127.0.0.1:0", "gateway.listen")
    assert addresses.parse("127.0.0.1:0", "gateway.accountant_listen", free_port=True) == ("127.0.0.1", 0)
    sock = zmq.Context.instance().socket(zmq.PULL)
    try:
        sock.bind(addresses.zmq_bind("127.0.0.1:0", "s", free_port=True))
        assert addresses.bound_port(sock.last_endpoint) > 0
    finally:
        sock.close(0)


def test_settings_refuse_a_bad_address_at_load_naming_it(tmp_path):
    with pytest.raises(settings.ConfigError, match=r"^controller.agent_listen is '7443', which has no port"):
        settings.load(None, {"controller.agent_listen": "7443"})
    with pytest.raises(settings.ConfigError, match="^gateway.listen is '127.0.0.1:0'.*port 0"):
        settings.load(None, {"gateway.listen": "127.0.0.1:0"})
    path = tmp_path / "c.toml"
    path.write_text('[agent]\ncontrollers = ["ctl:7443", "ctl"]\n')
    with pytest.raises(settings.ConfigError, match=rf"^agent.controllers is 'ctl'.*\(in {path}\)"):
        settings.load(str(path))
    with pytest.raises(settings.ConfigError, match="^mirror.api_allow: '10.0.0.0/33' is not an address"):
        settings.load(None, {"mirror.api_allow": ["10.0.0.0/33"]})
    cfg = settings.load(None, {"gateway.accountant_listen": "127.0.0.1:0", "gateway.controller": "",
                               "mirror.api": "http://models.internal:8082", "gateway.listen": "[::]:8080"})
    assert cfg.public_url() == "http://[::1]:8080"


def test_a_list_holds_networks_and_single_addresses():
    listed = AddressList(["10.1.0.0/16", "192.168.5.7", "fd00::/8", "10.9.9.9/24"], "gateway.trusted_proxies")
    assert listed.contains("10.1.200.3")
    assert listed.contains("192.168.5.7")
    assert not listed.contains("192.168.5.8")
    assert listed.contains("fd00::1")
    assert listed.contains("10.9.9.1")  # host bits in a network are forgiven, as people write them
    assert not listed.contains("not an address")
    assert not listed.contains(None)
    assert not AddressList([], "s").contains("127.0.0.1")


def test_an_ipv4_client_on_a_dual_stack_listener_matches_ipv4_entries():
    listed = AddressList(["10.1.0.0/16"], "mirror.api_allow")
    assert listed.contains("::ffff:10.1.2.3")
    assert not listed.contains("::ffff:10.2.2.3")


def test_a_bad_list_entry_is_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="^gateway.trusted_proxies: 'proxy.internal' is not an address"):
        AddressList(["proxy.internal"], "gateway.trusted_proxies")
