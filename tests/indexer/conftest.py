"""Session fixtures of the indexer tests (built once per test run, read-only: tests copy what they change)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def postprocess_env(tmp_path_factory):
    """Checkpoint with both NCL queues, captioned corpus and a --ncl-stage1 index
    (tests.indexer.postprocess_support.make_postprocess_env)."""
    from tests.indexer.postprocess_support import make_postprocess_env

    return make_postprocess_env(tmp_path_factory.mktemp("postprocess"))
