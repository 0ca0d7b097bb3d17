# The two quick-start commands (see README): `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,postgres]'

.PHONY: install demo test lint
install: $(PY)

demo: $(PY)
	$(VENV)/bin/chatflow-sqlalchemy demo

# Postgres tests run when CHATFLOW_TEST_POSTGRES_URL is set (and then fail loudly if the
# server is unreachable); otherwise testcontainers is tried, else they are skipped with a reason.
test: $(PY)
	$(PY) -m pytest

lint: $(PY)
	$(VENV)/bin/ruff check src tests migrations benchmarks
	$(VENV)/bin/mypy src
