"""Shared fixtures: small models built the way users build them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Tests start subprocesses that import the project from the checkout.
os.environ.setdefault("PYTHONPATH", str(REPO))

# In-process coordinators log through structlog; keep only warnings in the test output
# (tests that read logs run the coordinator as a subprocess with JSON logs).
from coordinator.cli import logs  # noqa: E402

logs.configure("console", "warning")
