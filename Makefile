# On a fresh machine (Python 3.11+, make): `make serve` and `make test`. Both make the project's virtual
# environment ($(VENV)) and install into it from requirements.lock, never into the system Python; the
# install runs again only when the lock changed since the last one.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
REPOSITORY ?= model_repository
# Extras of pyproject.toml installed into the venv (the gpu extra's CUDA wheels are for the GPU image).
EXTRAS ?= export dev load
# torch's CPU build comes from the PyTorch CPU index, unless a folder of PIP_FIND_LINKS has the wheel.
TORCH_INDEX ?= $(if $(wildcard $(addsuffix /torch-*+cpu-*.whl,$(PIP_FIND_LINKS))),,https://download.pytorch.org/whl/cpu)
PIP_TOOLS := pip-tools==7.6.2
LINT := $(PY) -m ruff check models export service tests bench scripts docs/examples

.PHONY: install install-ray install-gpu install-runtime check-lock lock export serve test test-ray lint browser tools bench bench-ray \
	perf-analyzer load soak membound container-lint compose-smoke deploy-lint docs docs-build

check-lock:  ## fail when pyproject.toml's dependencies changed and requirements.lock did not
	@$(PYTHON) scripts/lock.py check

# The locked dependencies, then the project itself, editable and without dependencies: its `attend`
# command lands in $(VENV)/bin.
$(VENV)/.installed: requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/lock.py requirements $(EXTRAS) >$(VENV)/requirements.txt
	$(PY) -m pip install -q -c requirements.lock -r $(VENV)/requirements.txt \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

install: check-lock $(VENV)/.installed  ## the venv: runtime, exporter, tests and locust, at the locked versions

# The ray extra (~600 MB installed) joins the same venv only for what needs it; again after every new lock.
$(VENV)/.installed-ray: $(VENV)/.installed
	$(PY) scripts/lock.py requirements ray >$(VENV)/requirements-ray.txt
	$(PY) -m pip install -q -c requirements.lock -r $(VENV)/requirements-ray.txt
	@touch $@

install-ray: install $(VENV)/.installed-ray  ## the venv plus Ray Serve (the ray extra), at the locked versions

# The gpu extra (onnxruntime-gpu's CUDA 13 and cuDNN 9 wheels, GBs) joins the venv on a GPU workstation; again
# after every new lock. Without it onnxruntime-gpu finds no CUDA libraries and the service runs on the CPU.
$(VENV)/.installed-gpu: $(VENV)/.installed
	$(PY) scripts/lock.py requirements gpu >$(VENV)/requirements-gpu.txt
	$(PY) -m pip install -q -c requirements.lock -r $(VENV)/requirements-gpu.txt
	@touch $@

install-gpu: install $(VENV)/.installed-gpu  ## the venv plus the gpu extra (CUDA wheels), for the CUDA execution provider

# Serving only (no torch, no tests, no locust): its own venv, the project's runtime dependencies at the locked
# versions plus RUNTIME_EXTRAS (gpu on a GPU machine). It serves a repository exported elsewhere (the exporter
# needs torch: `make export` in the full venv, or the image's).
RUNTIME_VENV ?= .venv-runtime
RUNTIME_EXTRAS ?=
install-runtime: check-lock  ## $(RUNTIME_VENV): the runtime dependencies only (plus RUNTIME_EXTRAS, e.g. gpu), to serve
	@$(MAKE) --no-print-directory $(RUNTIME_VENV)/.installed VENV=$(RUNTIME_VENV) EXTRAS="$(RUNTIME_EXTRAS)" TORCH_INDEX=

lock:  ## resolve every dependency of every extra again (after editing pyproject.toml) into requirements.lock
	@test -x $(VENV)-lock/bin/pip-compile || ($(PYTHON) -m venv $(VENV)-lock && $(VENV)-lock/bin/pip install -q $(PIP_TOOLS))
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)-lock/bin/pip-compile -q --all-extras --strip-extras \
		--no-emit-index-url --no-emit-find-links $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		-o requirements.lock pyproject.toml
	$(PYTHON) scripts/lock.py stamp

export: install  ## (re)export the default repository
	$(PY) -m export --repository $(REPOSITORY)

$(REPOSITORY):
	$(MAKE) export

serve: install $(REPOSITORY)  ## install, export the default repository if absent, serve it on :8000
	ATTEND_MODEL_REPOSITORY=$(REPOSITORY) $(PY) -m service

# The browser of tests/web: Debian's chromium (Playwright's own browser download is not reachable here).
CHROMIUM ?= $(or $(ATTEND_CHROMIUM),/usr/bin/chromium)
browser:  ## Debian's chromium for the page's browser tests, unless it is there or ATTEND_SKIP_BROWSER=1
	@test -x $(CHROMIUM) || [ "$$ATTEND_SKIP_BROWSER" = 1 ] || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# Every program the suite runs that a fresh Debian lacks (tests/test_tools.py reads them from the code and fails
# on one missing here). strace: the tests that count the service's system calls (a response in one write). wrk:
# the load generator of the bench scripts the tests run (bench/gc_cost.py, bench/where.py). curl: a client of
# the refusal tests and docs/examples/v2_curl.sh. promtool (Debian's prometheus package):
# tests/deploy/test_prometheus.py checks and unit-tests deploy/prometheus with it; the server the package starts
# under systemd is stopped and disabled again (only the tool is wanted).
tools:  ## Debian's strace, wrk, curl, openssl and promtool (the prometheus package) for the suite, unless they are there
	@command -v strace >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq strace >/dev/null)
	@command -v wrk >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null)
	@command -v curl >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null)
	@command -v openssl >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null)
	@command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends prometheus >/dev/null && (systemctl disable --now prometheus >/dev/null 2>&1 || true))

test: install browser tools  ## lint, then the whole suite but the Ray tests, as CI runs it (the page's tests in chromium included)
	$(LINT)
	$(PY) -m pytest -m "not ray"

test-ray: install-ray tools  ## the Ray Serve tests (a local Ray cluster; `ray stop` afterwards; wrk for bench-ray's test)
	$(PY) -m pytest -m ray

lint: install
	$(LINT)

# The documentation site (mkdocs.yml, docs/). Material for MkDocs prints a notice at every build without this.
DOCS_PORT ?= 8080
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: install  ## serve the documentation site on 127.0.0.1:$(DOCS_PORT) while you edit docs/
	$(MKDOCS) serve -a 127.0.0.1:$(DOCS_PORT)

docs-build: install  ## build the documentation site into build/site; a broken link or anchor fails (--strict)
	$(MKDOCS) build --strict

# BENCH_ARGS: e.g. "--rounds 1 --duration 2" for a shorter run, "--rows W1,W3,W1r" for some rows.
BENCH_ARGS ?=
bench: install $(REPOSITORY)  ## the service vs the plain server on varied bodies (wrk); writes docs/benchmarks.md, README's figure
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(PY) bench/run.py --repository $(REPOSITORY) --rounds 3 --duration 3 $(BENCH_ARGS) \
		--results docs/benchmarks.json --out docs/benchmarks.md --headline README.md

perf-analyzer: install  ## Triton's perf_analyzer against a fresh service (W2, a concurrency sweep), over HTTP, gRPC and its stream
	bash bench/perf_analyzer.sh --protocol http --concurrency "1 2 4 8 16"
	bash bench/perf_analyzer.sh --protocol grpc --concurrency "1 2 4 8 16"
	bash bench/perf_analyzer.sh --protocol grpc-stream --concurrency "1 2 4 8 16"

bench-ray: install-ray $(REPOSITORY)  ## python -m service against Ray Serve (1 and 2 replicas, each ingress mode; gRPC through its proxy)
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(PY) bench/ray_serve.py --duration 5 --repeat 3

load: install  ## locust, headless, 1 minute, against a service already running on :8000
	$(PY) -m locust -f tests/load/locustfile.py --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000 --only-summary

soak: install $(REPOSITORY)  ## locust against a fresh service for 4 minutes, memory sampled; pass/fail
	$(PY) tests/load/soak.py --repository $(REPOSITORY) --minutes 4

membound: install $(REPOSITORY)  ## each form of body: peak memory against what the service counts; writes docs/reliability.md
	$(PY) tests/load/membound.py --out docs/reliability.md

container-lint:  ## hadolint, docker compose config (every profile), shellcheck; no container engine needed
	bash tests/container/lint.sh

deploy-lint:  ## deploy/kubernetes against Kubernetes' schemas (kubernetes-validate, offline) and the service's settings
	bash tests/deploy/lint.sh

compose-smoke:  ## (root) build and run the CPU compose stack on a private dockerd: POST /attend, locust, down
	bash tests/container/smoke.sh
