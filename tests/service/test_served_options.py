"""The options a search request gets from the served index (gare_serve.engine.served_options): the manifest's
chosen K and NCL default fill what a request leaves out, within the service's bounds; what it gives is kept."""

from __future__ import annotations

import pytest

from gare_search import search as S
from gare_serve.engine.served_options import AskedOptions, ServedDefaults, resolve_options, served_defaults


def test_served_defaults_read_the_manifest_else_the_search_s_own():
    m = {"stage1": {"default_candidates": 64}, "biases": {"default": {"on": True, "reason": "helped R@1"}}}
    assert served_defaults(m) == ServedDefaults(64, True, "helped R@1")
    assert served_defaults({}) == ServedDefaults(None, S.NCL_DEFAULT, S.NCL_DEFAULT_REASON)
    # a record without a boolean decision is no decision
    assert served_defaults({"biases": {"default": {"on": "yes"}}}).ncl == S.NCL_DEFAULT


@pytest.mark.parametrize(("asked", "defaults", "want"), [
    # K: the index's own, at least k, at most the bound; else the service's default
    (AskedOptions(k=10), ServedDefaults(64, False, ""), S.SearchOptions(k=10, candidates=64, ncl=False)),
    (AskedOptions(k=100), ServedDefaults(64, False, ""), S.SearchOptions(k=100, candidates=100, ncl=False)),
    (AskedOptions(k=10), ServedDefaults(5000, False, ""), S.SearchOptions(k=10, candidates=1000, ncl=False)),
    (AskedOptions(k=10), ServedDefaults(None, False, ""), S.SearchOptions(k=10, candidates=256, ncl=False)),
    # what the request gives is kept
    (AskedOptions(k=10, candidates=32, rerank=False, ncl=False), ServedDefaults(64, True, ""),
     S.SearchOptions(k=10, candidates=32, rerank=False, ncl=False)),
    # ncl: the index's default when not given; ncl_stage1 implies it
    (AskedOptions(k=10), ServedDefaults(64, True, ""), S.SearchOptions(k=10, candidates=64, ncl=True)),
    (AskedOptions(k=10, ncl=False, ncl_stage1=True), ServedDefaults(64, False, ""),
     S.SearchOptions(k=10, candidates=64, ncl=True, ncl_stage1=True)),
])
def test_resolve_options(asked, defaults, want):
    assert resolve_options(asked, defaults, max_candidates=1000, default_candidates=256) == want
