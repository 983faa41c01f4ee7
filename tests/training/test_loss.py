"""Each GARE loss against a hand-computed value, and which parameters receive gradients."""

from __future__ import annotations

import math

import torch

from gare.config import LossConfig
from gare_train.loss import dir_loss, eps_loss, gare_loss, ib_loss, info_nce


def test_info_nce_hand_computed():
    s = torch.tensor([[0.5, 0.1], [0.2, 0.4]])
    scale = torch.tensor(math.log(10.0))  # exp -> 10
    # rows: t2v, columns: v2t, logits = 10 s
    t2v = -(5 - math.log(math.exp(5) + math.exp(1)) + 4 - math.log(math.exp(2) + math.exp(4))) / 2
    v2t = -(5 - math.log(math.exp(5) + math.exp(2)) + 4 - math.log(math.exp(1) + math.exp(4))) / 2
    assert abs(info_nce(s, scale).item() - (t2v + v2t) / 2) < 1e-6


def test_ib_kl_of_known_gaussian():
    # two texts, one video, d = 2: Δ_0 = (1, 3), Δ_1 = (3, 3) -> μ = (2, 3), σ = (√2, 0) + 1e-6
    delta = torch.tensor([[[1.0, 3.0]], [[3.0, 3.0]]])
    mu = [2.0, 3.0]
    sig = [math.sqrt(2) + 1e-6, 1e-6]
    expected = sum(0.5 * (s * s + m * m - 1) - math.log(s) for m, s in zip(mu, sig, strict=True))
    assert abs(ib_loss(delta).item() - expected) < 1e-4
    # and the library KL of the same distributions agrees (summed over d, mean over videos)
    from torch.distributions import Independent, Normal, kl_divergence

    d = torch.randn(5, 3, 4)
    ref = kl_divergence(
        Independent(Normal(d.mean(0), d.std(0) + 1e-6), 1), Independent(Normal(torch.zeros(3, 4), torch.ones(3, 4)), 1)
    ).mean()
    assert abs(ib_loss(d).item() - ref.item()) < 1e-4


def test_ib_zero_for_standard_normal_statistics():
    # μ = 0, σ = 1 exactly in every dimension -> KL = 0 (up to the 1e-6)
    delta = torch.tensor([[[1.0, -1.0]], [[-1.0, 1.0]]]) / math.sqrt(2)
    assert abs(ib_loss(delta).item()) < 1e-5


def test_dir_loss_orthogonal_and_identical():
    b, alpha = 3, 2.0
    ortho = torch.eye(b).unsqueeze(0).repeat(2, 1, 1)  # per text: b orthogonal directions
    expected = math.log((b + (b * b - b) * math.exp(-alpha)) / (b * b) + 1e-8)
    assert abs(dir_loss(ortho, alpha).item() - expected) < 1e-6
    same = torch.ones(2, b, 4)
    assert abs(dir_loss(same, alpha).item() - math.log(1 + 1e-8)) < 1e-6


def test_eps_loss_both_sides_of_lower_bound():
    # radii per text: (1, 3) -> unbiased var 2; (2, 2) -> 0; mean -> 1; loss = -1
    delta = torch.zeros(2, 2, 3)
    delta[0, 0, 0], delta[0, 1, 1], delta[1, 0, 2], delta[1, 1, 0] = 1, 3, 2, 2
    assert eps_loss(delta, lambda_lower=2.0).item() == -1.0  # -1 >= -2: counted
    cut = eps_loss(delta.requires_grad_(), lambda_lower=0.5)  # -1 < -0.5: truncated to 0
    assert cut.item() == 0.0
    cut.backward()
    assert delta.grad.abs().sum() == 0
    small = torch.zeros(1, 2, 2)
    small[0, 0, 0], small[0, 1, 0] = 0.5, 1.0  # var = 0.125 -> -0.125 >= -0.5
    assert abs(eps_loss(small, 0.5).item() + 0.125) < 1e-7


def test_total_is_weighted_sum():
    torch.manual_seed(0)
    s, delta = torch.rand(4, 4), torch.randn(4, 4, 8)
    cfg = LossConfig(beta=0.5, lambda_dir=0.25, lambda_eps=2.0, lambda_lower=100.0)
    t = gare_loss(s, delta, torch.tensor(2.0), cfg)
    assert set(t) == {"info", "ib", "dir", "eps", "total"}
    expected = t["info"] + 0.5 * t["ib"] + 2.0 * t["eps"] + 0.25 * t["dir"]
    assert abs(t["total"].item() - expected.item()) < 1e-6


def test_exactly_the_intended_parameters_get_gradients(tiny_model):
    model = tiny_model.train()
    cfg = model.cfg
    texts = ["a red circle", "a blue square", "two green triangles"]
    frames = torch.randn(3, cfg.max_frames, 3, cfg.image_size, cfg.image_size)
    mask = torch.ones(3, cfg.max_frames, dtype=torch.long)
    t = model.encode_text(model.tokenize(texts))
    Fe, vbar = model.encode_video(frames, mask)
    s, delta = model.pair_logits(t, Fe, mask, vbar)
    terms = gare_loss(s, delta, model.clip.logit_scale, LossConfig(lambda_lower=1e9))
    terms["total"].backward()
    no_grad = {n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0}
    # log_sigma exists for checkpoint compatibility only; no loss uses it.
    assert no_grad == {"psi.log_sigma.weight", "psi.log_sigma.bias"}, no_grad
    # the regularisers alone reach psi but not the CLIP text tower's logit scale
    model.zero_grad()
    s, delta = model.pair_logits(t.detach(), Fe.detach(), mask, vbar.detach())
    (ib_loss(delta) + dir_loss(delta)).backward()
    assert model.clip.logit_scale.grad is None
    assert model.psi.mu.weight.grad.abs().sum() > 0
