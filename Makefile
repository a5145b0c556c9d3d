PYTHON ?= python3
REPOSITORY ?= model_repository

.PHONY: install export serve test lint

install:  ## runtime + exporter + test dependencies (torch pinned to the local CPU wheel)
	$(PYTHON) -m pip install -q -e '.[export,dev]'

export: install  ## (re)export the default repository
	$(PYTHON) -m export --repository $(REPOSITORY)

$(REPOSITORY):
	$(PYTHON) -m export --repository $(REPOSITORY)

serve: install $(REPOSITORY)  ## install, export the default repository if absent, serve it
	@if $(PYTHON) -c 'import service.__main__' 2>/dev/null; then \
		ATTEND_MODEL_REPOSITORY=$(REPOSITORY) $(PYTHON) -m service; \
	else echo "exported $(REPOSITORY); the service is not built yet"; fi

test: install  ## the whole suite, as CI runs it
	$(PYTHON) -m ruff check models export service tests
	$(PYTHON) -m pytest

lint:
	$(PYTHON) -m ruff check models export service tests
