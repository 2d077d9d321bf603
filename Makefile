# The two commands of the README. Both install what they need into .venv first.
VENV  := .venv
STAMP := $(VENV)/.installed

.PHONY: up test lint

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh

up: $(STAMP)
	$(VENV)/bin/diffcache up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest
