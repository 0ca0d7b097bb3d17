"""chatflow-sqlalchemy's conformance suite, run on MariaDB (see conftest.py)."""

import pytest
from chatflow_sqlalchemy.testing.suite import *  # noqa: F403

pytestmark = pytest.mark.mariadb
