"""The search's `ncl` default is one constant (gare_search.search.NCL_DEFAULT) that the API and the page follow,
and `describe_biases` says which score an index's biases were fitted to. (That the constant follows the committed
measurements is checked in tests/test_evidence.py.)"""

from __future__ import annotations

from pathlib import Path

from gare_index.describe import describe_biases as describe
from gare_search.search import NCL_DEFAULT, SearchOptions
from gare_serve.web.schemas import IndexInfo

REPO = Path(__file__).resolve().parents[2]


def test_service_and_page_agree_with_the_default():
    assert SearchOptions().ncl is NCL_DEFAULT
    assert IndexInfo.model_fields["ncl_default"].default is NCL_DEFAULT
    html = (REPO / "service" / "gare_serve" / "web" / "static" / "index.html").read_text()
    line = next(ln for ln in html.splitlines() if 'id="ncl"' in ln)
    assert ("checked" in line) is NCL_DEFAULT


def test_describe_says_which_score_the_biases_fit():
    served = {"gamma": 0.01, "n_iters": 4, "n_queries": 100, "source": "checkpoint-queue", "score": "served",
              "served": {"form": "sparse", "k": 256, "fill": "dual"}}
    assert "psi score" in describe(served) and "top 256" in describe(served) and "cosine elsewhere" in describe(served)
    assert "dual-tower cosine" in describe({**served, "score": "dual"})
    assert "dual-tower cosine" in describe({k: v for k, v in served.items() if k not in ("score", "served")})
    assert "no NCL biases" in describe({"source": "none", "n_queries": 0})
