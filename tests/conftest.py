"""Shared fixtures: a real in-process coordinator per test, and the test-wide settings."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Tests start subprocesses that import the project from the checkout.
os.environ.setdefault("PYTHONPATH", str(REPO))

# In-process coordinators log through structlog; keep only warnings in the test output
# (tests that read logs run the coordinator as a subprocess with JSON logs).
from coordinator.cli import logs  # noqa: E402
from tests.helpers import InProcessCoordinator  # noqa: E402

logs.configure("console", "warning")


@pytest.fixture
def coord(request: pytest.FixtureRequest) -> Iterator[InProcessCoordinator]:
    """A real coordinator on a free loopback port. A test module sets JOIN_DEADLINE (seconds)
    where its tests wait out, or must not wait out, the deadline; the default is 30 s."""
    c = InProcessCoordinator(
        join_deadline=getattr(request.module, "JOIN_DEADLINE", 30.0), progress_interval=0.2
    )
    yield c
    c.stop()
