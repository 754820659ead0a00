# Two commands set everything up on a fresh machine:
#   make demo   installs edgepfl in .venv and runs a federated training over an embedded MQTT broker
#   make test   installs the test tools (and Mosquitto through apt-get when root), runs ruff and mypy
#               on edge_sdk, coordinator, export, benchmarks, harness and all of tests, runs all tests
#               (naming the slowest), then checks that targeted breaks of the seed methods' objectives and
#               of the switches fail their tests (those whose module or tests changed since they were last
#               caught, tests/mutations_caught.json; `make mutations` runs them all)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
APT_PACKAGES := mosquitto nats-server iproute2 dataset-fashion-mnist prometheus chromium
# Test processes at once (pytest-xdist workers, a file's tests together; mutation check jobs): the
# integration tests wait on brokers and subprocesses much of the time, so 2 keep a 2-core machine busy.
TEST_JOBS ?= 2
# The mutation check's jobs: many of its breaks leave a test waiting on a broker or a timeout, and a
# break that fails only under load counts as caught, so one job more than TEST_JOBS shortens it and cannot fail a passing tree.
MUTATION_JOBS ?= 3

.PHONY: demo test mutations install system-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

# Mosquitto for the integration tests, nats-server and iproute2 for the cluster tests (network
# namespaces), Fashion-MNIST for the dataset tests, Prometheus for the metrics test and Chromium
# (headless) for the live view's browser test; needs root.
system-deps:
	@missing=""; \
	[ -x /usr/sbin/mosquitto ] || command -v mosquitto >/dev/null 2>&1 || missing="$$missing mosquitto"; \
	[ -x /usr/sbin/nats-server ] || command -v nats-server >/dev/null 2>&1 || missing="$$missing nats-server"; \
	[ -x /usr/bin/prometheus ] || command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || missing="$$missing iproute2"; \
	[ -d /usr/share/datasets/fashion-mnist ] || missing="$$missing dataset-fashion-mnist"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "not root: install$$missing yourself (sudo apt-get install$$missing)"; fi; \
	fi

demo: install
	$(BIN)/edgepfl simulate --algorithm fedavg --dataset digits --clients 10 --rounds 5 --out runs/demo

test: install system-deps
	$(BIN)/ruff check edge_sdk coordinator export benchmarks harness tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not alone" --durations=20
	$(BIN)/python -m pytest -q -m alone --durations=3
	$(BIN)/python tests/mutation_check.py --jobs $(MUTATION_JOBS) --baseline-passed --changed --record

# Every mutation, its tests first run unmutated; the caught ones' fingerprints go to tests/mutations_caught.json.
mutations: install
	$(BIN)/python tests/mutation_check.py --jobs $(MUTATION_JOBS) --record

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
