"""Shared fixtures: small models built the way users build them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Tests start subprocesses that import the project from the checkout.
os.environ.setdefault("PYTHONPATH", str(REPO))
