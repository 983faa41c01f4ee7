"""psi_consts.fold_of's cache (issue 29): an unchanged psi is not walked and folded again; a weight changed in
place, a parameter rebound, or another module gives a new fold equal to fold_weights of the changed psi; and
IndexVersion.rows' dense id table agrees with the binary search it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare.psi_fold_weights import fold_weights
from gare_index import psi_consts


def _same(a, b) -> bool:
    return a.fingerprint == b.fingerprint


def test_unchanged_psi_is_folded_once(tiny_model):
    first = psi_consts.fold_of(tiny_model)
    count = psi_consts.FOLD_COUNT[0]
    for _ in range(5):
        assert psi_consts.fold_of(tiny_model) is first
    assert psi_consts.FOLD_COUNT[0] == count


def test_in_place_change_and_rebind_give_a_new_fold(tiny_cfg):
    from gare.model import GARE

    torch.manual_seed(3)
    model = GARE.build(tiny_cfg).eval()
    before = psi_consts.fold_of(model)
    count = psi_consts.FOLD_COUNT[0]
    p = next(model.psi.parameters())
    with torch.no_grad():
        p.add_(0.25)  # in place: same tensor, new _version
    after = psi_consts.fold_of(model)
    assert psi_consts.FOLD_COUNT[0] == count + 1 and not _same(after, before)
    assert _same(after, fold_weights(model.psi))
    assert psi_consts.fold_of(model) is after  # and cached again
    # a parameter rebound to another tensor (load_state_dict(assign=True) does this)
    mod = next(m for m in model.psi.modules() if "weight" in m._parameters and m._parameters["weight"] is not None)
    mod.weight = torch.nn.Parameter(mod.weight.detach().clone() * 1.5)
    rebound = psi_consts.fold_of(model)
    assert not _same(rebound, after) and _same(rebound, fold_weights(model.psi))
    # another model with equal weights: its own entry, the same fingerprint
    twin = GARE.build(tiny_cfg).eval()
    twin.load_state_dict(model.state_dict())
    assert _same(psi_consts.fold_of(twin), rebound)


@pytest.mark.parametrize("ids", [np.array([5, 0, 9, 2, 7]), np.array([3, 10**9, 1, -4])])
def test_rows_dense_table_equals_binary_search(model_and_index, ids):
    """Compact ids use the dense table, sparse or negative ones the binary search: same rows, same KeyError."""
    import dataclasses

    _, version, _ = model_and_index
    fake = dataclasses.replace(version, ids=ids)  # the same reader over other ids (only ids matter to rows())
    assert (fake._lut is not None) == bool(ids.min() >= 0 and ids.max() < 4 * ids.size + 1024)
    order = np.random.default_rng(0).permutation(ids.size)
    np.testing.assert_array_equal(fake.rows(ids[order]), order)
    absent = np.array([int(ids.max()) - 1 if int(ids.max()) - 1 not in ids else 4])
    np.testing.assert_array_equal(fake.rows(absent, missing="mask"), [-1])
    with pytest.raises(KeyError, match="ids not in index"):
        fake.rows(np.concatenate([ids[:2], absent]))
