"""The P/D deployment the tests run: examples/pd_servers.py, as users run it (the demo too)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pd_servers import PD, start_pd

__all__ = ["PD", "start_pd"]
