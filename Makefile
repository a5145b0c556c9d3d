PYTHON ?= python3
REPOSITORY ?= model_repository

.PHONY: install export serve test lint bench load soak membound container-lint compose-smoke

install:  ## runtime + exporter + test dependencies (torch pinned to the local CPU wheel)
	$(PYTHON) -m pip install -q -e '.[export,dev]'

export: install  ## (re)export the default repository
	$(PYTHON) -m export --repository $(REPOSITORY)

$(REPOSITORY):
	$(PYTHON) -m export --repository $(REPOSITORY)

serve: install $(REPOSITORY)  ## install, export the default repository if absent, serve it on :8000
	ATTEND_MODEL_REPOSITORY=$(REPOSITORY) $(PYTHON) -m service

test: install  ## the whole suite, as CI runs it
	$(PYTHON) -m ruff check models export service tests bench
	$(PYTHON) -m pytest

lint:
	$(PYTHON) -m ruff check models export service tests bench

bench: install $(REPOSITORY)  ## wrk against the service vs the in-process limit; writes docs/benchmarks.md
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(PYTHON) bench/run.py --repository $(REPOSITORY) --duration 8 --repeat 3 --out docs/benchmarks.md

load:  ## locust, headless, 1 minute, against a service already running on :8000
	$(PYTHON) -m pip install -q -e '.[load]'
	$(PYTHON) -m locust -f tests/load/locustfile.py --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000 --only-summary

soak: install $(REPOSITORY)  ## locust against a fresh service for 4 minutes, memory sampled; pass/fail
	$(PYTHON) -m pip install -q -e '.[load]'
	$(PYTHON) tests/load/soak.py --repository $(REPOSITORY) --minutes 4

membound: install $(REPOSITORY)  ## peak memory of the largest requests the default limits allow
	$(PYTHON) tests/load/membound.py

container-lint:  ## hadolint, docker compose config (every profile), shellcheck; no container engine needed
	bash tests/container/lint.sh

compose-smoke:  ## (root) build and run the CPU compose stack on a private dockerd: POST /attend, locust, down
	bash tests/container/smoke.sh
