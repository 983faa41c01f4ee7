"""Logging set-up shared by the command-line tools (gare-train, gare-index, gare-serve, the demo).

Third-party libraries log on the root logger (open_clip: "No potential checkpoint path found",
"Instantiating model architecture", "Using default SimpleTokenizer"); those lines say nothing to a user, so
by default only our own packages log at INFO and everything else at WARNING. `-v` shows everything at DEBUG.
"""

from __future__ import annotations

import logging

OUR_PACKAGES = ("gare", "gare_index", "gare_search", "gare_build", "gare_serve", "gare_train", "gare_demo", "bench")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_cli_logging(verbose: bool = False, *, level: str | int = logging.INFO) -> None:
    """Root (third-party) at WARNING, our packages at `level`; with `verbose` both at DEBUG.

    `force=True` replaces handlers a library may have installed at import time, so the result does not depend
    on import order."""
    root_level = logging.DEBUG if verbose else logging.WARNING
    ours = logging.DEBUG if verbose else (logging.getLevelName(level.upper()) if isinstance(level, str) else level)
    logging.basicConfig(level=root_level, format=FORMAT, force=True)
    for name in OUR_PACKAGES:
        logging.getLogger(name).setLevel(ours)
