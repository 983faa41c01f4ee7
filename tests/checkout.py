"""Where the checkout under test is, and the path a child process needs to run its code whether or not the project
is installed: the three source roots hold the packages, the root holds tests/."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKOUT_PATH = os.pathsep.join(str(REPO / root) for root in ("training", "indexer", "service", "."))
