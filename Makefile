# The two commands of the README. Both install what they need into .venv first.
VENV  := .venv
# mkdocs-material prints a notice about MkDocs 2 at every build: not ours to act on.
export NO_MKDOCS_2_WARNING := 1
export DISABLE_MKDOCS_2_WARNING := true
STAMP := $(VENV)/.installed

.PHONY: up test test-fast lint docs test-deps

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh

up: $(STAMP)
	$(VENV)/bin/diffcache up

# Debian's chromium renders the dashboard and the documentation in their tests.
test-deps:
	bash scripts/bootstrap.sh --test

# Style, types, the import contracts (pyproject.toml [tool.importlinter]) and the documentation
# site, built strictly: a broken link or a page missing from its navigation fails.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site

test: test-deps lint
	$(VENV)/bin/pytest

# The tests that start no worker process, browser or whole service, for a quick loop.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not slow"

# The documentation site, into site/ (open site/index.html).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --site-dir site
