PYTHON ?= python3
REPOSITORY ?= model_repository

.PHONY: install export serve test lint

install:  ## runtime + exporter + test dependencies (torch pinned to the local CPU wheel)
	$(PYTHON) -m pip install -q -e '.[export,dev]'

export: install  ## (re)export the default repository
	$(PYTHON) -m export --repository $(REPOSITORY)

$(REPOSITORY):
	$(PYTHON) -m export --repository $(REPOSITORY)

serve: install $(REPOSITORY)  ## install, export the default repository if absent, serve it on :8000
	ATTEND_MODEL_REPOSITORY=$(REPOSITORY) $(PYTHON) -m service

test: install  ## the whole suite, as CI runs it
	$(PYTHON) -m ruff check models export service tests
	$(PYTHON) -m pytest

lint:
	$(PYTHON) -m ruff check models export service tests
