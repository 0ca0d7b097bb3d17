# The two quick-start commands (see README): `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PLUGIN := plugins/chatflow-sqlalchemy-mariadb
STAMP := $(VENV)/.installed

# The core package and the MariaDB plugin beside it, both editable; reinstalled
# whenever either pyproject.toml changes.
$(STAMP): pyproject.toml $(PLUGIN)/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,postgres]' -e $(PLUGIN)
	touch $(STAMP)

.PHONY: install demo test lint docs
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/chatflow-sqlalchemy demo

# Everything, in one pytest run: the core suite and the MariaDB plugin's tests.
# PostgreSQL tests run when CHATFLOW_TEST_POSTGRES_URL is set (and then fail loudly if the
# server is unreachable); otherwise testcontainers is tried, else they are skipped with a
# reason. MariaDB tests run when CHATFLOW_TEST_MARIADB_URL is set (same rules), else they
# are skipped with a reason.
#
# Four pytest-xdist workers, work-stealing: most tests wait on a server, a lease or a
# worker process rather than on the CPU, so four overlap well even on two cores. Every
# test has its own SQLite file, PostgreSQL schema or MariaDB database, free ports and
# private clusters; PostgreSQL's advisory locks are per database, so the tests that look
# at a session's turn lock use session ids of their own. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 4
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests migrations benchmarks plugins examples
	$(VENV)/bin/mypy src
	cd $(PLUGIN) && $(abspath $(VENV))/bin/mypy

# The API reference (mkdocs + mkdocstrings, from the docstrings) into site/; warnings fail.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict
