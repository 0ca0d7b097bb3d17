"""The conformance kit's worker processes (``testing.harness.worker_context``).

They start from a fork server (where the platform has one) that preloaded the
libraries; they must still behave as freshly spawned processes would: the
test process's environment as it is when they start, and no state shared with
the test process.
"""

from __future__ import annotations

import os
import sys

import pytest

from chatflow_sqlalchemy.testing.harness import START_METHOD_ENV, run_process, worker_context

PROBE = "CHATFLOW_TEST_WORKER_PROBE"


def exit_with_probe() -> None:
    """Exit 0 if the probe variable is set as the test set it, else 3."""
    sys.exit(0 if os.environ.get(PROBE) == "set after the server started" else 3)


def test_a_worker_sees_the_environment_of_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROBE, raising=False)
    assert run_process(exit_with_probe, ()) == 3  # the server is up now, without the probe
    monkeypatch.setenv(PROBE, "set after the server started")
    assert run_process(exit_with_probe, ()) == 0


def test_spawn_can_be_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert worker_context().get_start_method() == "spawn"
    monkeypatch.setenv(PROBE, "set after the server started")
    assert run_process(exit_with_probe, ()) == 0
