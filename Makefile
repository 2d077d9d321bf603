# The two commands of the README. Both install what they need into .venv first.
VENV  := .venv
STAMP := $(VENV)/.installed

.PHONY: up test test-fast lint test-deps

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh

up: $(STAMP)
	$(VENV)/bin/diffcache up

# Debian's chromium renders the dashboard in the dashboard test.
test-deps:
	bash scripts/bootstrap.sh --test

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: test-deps lint
	$(VENV)/bin/pytest

# The tests that start no worker process, browser or whole service, for a quick loop.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not slow"
