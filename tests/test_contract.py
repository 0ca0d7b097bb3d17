"""The shipped conformance suite, run against every built-in backend (see conftest.py)."""

from chatflow_sqlalchemy.testing.suite import *  # noqa: F403
