"""Fixtures of the robustness tests: `figure` records what a test observed for bench/robustness.py."""

from __future__ import annotations

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture()
def figure(request):
    """`fig = figure("name", rows=[])`: a dict the test fills with what it observes, recorded for
    bench/robustness.py when the test ends, pass or fail (a failure adds `error`: the report then shows
    what was observed up to the failure and why it stopped)."""
    from tests.robustness.test_robust_common import record

    figs: dict[str, dict] = {}

    def make(name: str, **initial):
        figs[name] = dict(initial)
        return figs[name]

    yield make
    rep = getattr(request.node, "rep_call", None)
    for name, fig in figs.items():
        if rep is not None and rep.failed:
            crash = getattr(rep.longrepr, "reprcrash", None)
            fig["error"] = str(crash.message if crash is not None else rep.longrepr)[:600]
        record(name, fig)


@pytest.fixture(scope="session")
def robust_env(tmp_path_factory, ckpt):
    """{root, checkpoint, videos, base_lib, base_index} (test_robust_common.make_robust_env; the checkpoint is
    the session's `ckpt`), built once per test run; read-only: tests copy what they change."""
    from tests.robustness.test_robust_common import make_robust_env

    return make_robust_env(tmp_path_factory.mktemp("robust"), ckpt)


@pytest.fixture(scope="session")
def live_env(robust_env, tmp_path_factory):
    """{srv, index, lib, key}: one `gare-serve` on 127.0.0.1 shared by the robustness tests of this run
    (test_robust_common.start_live_server), stopped when the session ends."""
    from tests.robustness.test_robust_common import start_live_server

    live = start_live_server(robust_env, tmp_path_factory.mktemp("robust-live"))
    yield live
    live["srv"].__exit__(None, None, None)
