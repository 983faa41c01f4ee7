"""Issue 15 evaluation figures: the rebuttal's deviation (Δ alone) and v2t NCL with text-side biases."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from gare.deviation import delta_deviation
from gare.encoded_set import EncodedSet
from gare.retrieval_metrics import retrieval_metrics
from gare.sinkhorn import sinkhorn_biases_naive
from gare_train.evaluate import evaluate_encoded, write_report


def _encoded(model, n_texts=7, n_videos=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    d, f = model.cfg.embed_dim, model.cfg.max_frames
    mask = torch.ones(n_videos, f, dtype=torch.long)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    frames = torch.randn(n_videos, f, d, generator=g) * mask[..., None]
    vbar = (frames * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    t = torch.randn(n_texts, d, generator=g)
    caption_clip = np.arange(n_texts) % n_videos
    return EncodedSet(t=t, frames=frames, mask=mask, vbar=vbar, caption_clip=caption_clip)


@torch.no_grad()
def test_rebuttal_deviation_is_delta_alone_with_the_same_video_vector(tiny_model):
    enc = _encoded(tiny_model)
    got = delta_deviation(tiny_model, enc.t, enc.frames, enc.mask, enc.vbar, block=2)
    want = torch.empty_like(got)
    for i in range(enc.t.shape[0]):
        for j in range(enc.vbar.shape[0]):
            _, delta = tiny_model.score(enc.t[i:i + 1], enc.frames[j:j + 1], enc.mask[j:j + 1], return_delta=True)
            v = enc.vbar[j]
            want[i, j] = (F.cosine_similarity(enc.t[i] + delta[0, 0], v, dim=0) - F.cosine_similarity(enc.t[i], v, dim=0)).abs()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    res = evaluate_encoded(tiny_model, enc, None)
    dv = res["deviation"]
    assert abs(dv["delta_mean_abs"] - float(want.mean())) < 1e-5
    assert abs(dv["delta_p95_abs"] - float(np.percentile(want.numpy(), 95))) < 1e-5
    # the old figure (Δ and the pooling together) is kept, labelled, and is a different number
    psi = tiny_model.score(enc.t, enc.frames, enc.mask, vbar=enc.vbar)
    dual = F.normalize(enc.t, dim=-1) @ F.normalize(enc.vbar, dim=-1).T
    assert abs(dv["mean_abs"] - float((psi - dual).abs().mean())) < 1e-5
    assert abs(dv["mean_abs"] - dv["delta_mean_abs"]) > 1e-3


@torch.no_grad()
def test_v2t_ncl_uses_text_biases_fitted_with_the_video_queue(tiny_model, tmp_path):
    enc = _encoded(tiny_model, n_texts=12, n_videos=6, seed=1)
    g = torch.Generator().manual_seed(2)
    d = tiny_model.cfg.embed_dim
    text_queue, video_queue = torch.randn(40, d, generator=g), torch.randn(30, d, generator=g)
    res = evaluate_encoded(tiny_model, enc, text_queue, video_queue=video_queue)
    gamma = float(1.0 / tiny_model.clip.logit_scale.exp())
    tn, vn = F.normalize(enc.t, dim=-1), F.normalize(enc.vbar, dim=-1)
    dual = tn @ vn.T
    _, b_vid = sinkhorn_biases_naive(F.normalize(text_queue, dim=-1) @ vn.T, gamma)
    _, a_txt = sinkhorn_biases_naive(F.normalize(video_queue, dim=-1) @ tn.T, gamma)
    want_t2v = retrieval_metrics(dual + b_vid.float()[None], enc.caption_clip)["t2v"]
    want_v2t = retrieval_metrics(dual + a_txt.float()[:, None], enc.caption_clip)["v2t"]
    assert res["rows"]["+ NCL"]["t2v"] == want_t2v
    assert res["rows"]["+ NCL"]["v2t"] == want_v2t
    # the per-video bias alone would leave v2t exactly as the dual tower: the text biases must reach it
    assert retrieval_metrics(dual + b_vid.float()[None], enc.caption_clip)["v2t"] == res["rows"]["dual-tower"]["v2t"]
    # psi cannot score queued videos (no frames): that cell is not offered rather than a copy of the baseline
    assert all(np.isnan(v) for v in res["rows"]["+ psi + NCL(dual)"]["v2t"].values())
    md = write_report(res, tmp_path)["md"].read_text()
    assert "| + psi + NCL(dual) |" in md and "| + psi + NCL(served) |" in md and "| - | - |" in md and "video queue" in md
    assert "0.084" in md and "Δ alone" in md and "not the rebuttal's figure" in md
