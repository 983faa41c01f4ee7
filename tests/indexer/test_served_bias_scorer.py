"""The served-score NCL biases score queue pairs through the psi fold by default (issue 12 + 17): the fold
pair scorer must give the fused psi scorer's values (which equal ``model.score``) on padded videos."""

import numpy as np
import torch

from gare_build.served_biases import fold_pair_scorer, served_biases
from tests.psi_reference import fused_pair_scorer


def _gallery(model, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    d, f = model.cfg.embed_dim, model.cfg.max_frames
    frames = torch.randn(n, f, d, generator=g) * 0.7
    lengths = torch.randint(1, f + 1, (n,), generator=g)
    masks = torch.arange(f)[None, :] < lengths[:, None]
    frames = (frames * masks[..., None]).half().numpy()
    vbar = (torch.from_numpy(frames).float() * masks[..., None]).sum(1) / masks.sum(1, keepdim=True)
    norms = vbar.norm(dim=-1).numpy()
    units = (vbar / vbar.norm(dim=-1, keepdim=True)).numpy()
    return frames, masks.numpy(), units, norms


def test_fold_pair_scorer_equals_the_fused_scorer(tiny_model):
    frames, masks, units, norms = _gallery(tiny_model)
    q = torch.randn(5, tiny_model.cfg.embed_dim, generator=torch.Generator().manual_seed(1)).numpy()
    qi = np.repeat(np.arange(5), 9)
    rows = np.tile(np.arange(9), 5)
    fused = fused_pair_scorer(tiny_model, q, frames, masks, units, norms)(qi, rows)
    fold = fold_pair_scorer(tiny_model, q, frames, masks, units, norms, chunk=7)(qi, rows)  # chunks split queries
    torch.testing.assert_close(fold, fused, atol=1e-5, rtol=0)
    # and both equal model.score on the same (served) numbers
    with torch.no_grad():
        ref = tiny_model.score(torch.from_numpy(q), torch.from_numpy(frames).float(), torch.from_numpy(masks))
    torch.testing.assert_close(fold.view(5, 9), ref.float(), atol=1e-4, rtol=0)


def test_served_biases_default_scorer_is_the_fold(tiny_model):
    frames, masks, units, norms = _gallery(tiny_model, n=12, seed=3)
    q = torch.randn(20, tiny_model.cfg.embed_dim, generator=torch.Generator().manual_seed(4)).numpy()
    kw = dict(units=units, norms=norms, frames=frames, masks=masks, k=12, device="cpu")
    b_default, info = served_biases(tiny_model, q, 0.05, **kw)
    b_fused, _ = served_biases(tiny_model, q, 0.05, scorer=fused_pair_scorer(tiny_model, q, frames, masks, units, norms), **kw)
    assert info["form"] == "dense"
    np.testing.assert_allclose(b_default, b_fused, atol=1e-4)


def test_fold_pair_scorer_reads_stored_constants(tiny_model):
    """With the index's stored constants (what build/add/remove pass) the scorer reads rows instead of folding
    them: the same scores; constants of the wrong shape are refused; constants that are not this psi's
    change the scores (so the stored path really reads them)."""
    from gare_index import psi_consts

    frames, masks, units, norms = _gallery(tiny_model, n=11, seed=5)
    q = torch.randn(4, tiny_model.cfg.embed_dim, generator=torch.Generator().manual_seed(6)).numpy()
    out = np.empty((11, psi_consts.packed_width(frames.shape[1])), np.float32)
    psi_consts.compute_rows(psi_consts.fold_of(tiny_model), frames, masks, units, norms, out, np.arange(11), device="cpu")
    qi, rows = np.repeat(np.arange(4), 11), np.tile(np.arange(11), 4)
    folded = fold_pair_scorer(tiny_model, q, frames, masks, units, norms, chunk=5)(qi, rows)
    stored = fold_pair_scorer(tiny_model, q, frames, masks, units, norms, consts=out, chunk=5)(qi, rows)
    torch.testing.assert_close(stored, folded, atol=1e-5, rtol=0)
    # one chunk holding whole queries (queue order): the grouped product path, in either order of the pairs
    grouped = fold_pair_scorer(tiny_model, q, frames, masks, units, norms, consts=out, chunk=1024)
    torch.testing.assert_close(grouped(qi, rows), folded, atol=1e-5, rtol=0)
    perm = np.random.default_rng(0).permutation(qi.size)
    torch.testing.assert_close(grouped(qi[perm], rows[perm]), folded[perm], atol=1e-5, rtol=0)
    try:
        fold_pair_scorer(tiny_model, q, frames, masks, units, norms, consts=out[:, :-1])
        raise AssertionError("a wrong-width constants array was accepted")
    except ValueError as e:
        assert "psi constants have shape" in str(e)
    wrong = fold_pair_scorer(tiny_model, q, frames, masks, units, norms, consts=out * 1.5, chunk=5)(qi, rows)
    assert float((wrong - folded).abs().max()) > 1e-3
