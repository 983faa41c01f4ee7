"""The authors' optimizer (gare_train.optim.BertAdam) and schedule against hand-computed steps, and
`gare-train fit --optimizer bertadam` end to end (issue 28, must-have 6).

The formulas the hand values follow (musicman217/GARE-text-video-retrieval, tvr/models/optimization.py), per
tensor: g <- g * min(1, max_norm / (|g| + 1e-6)); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
u <- m / (sqrt(v) + eps) + wd * p; p <- p - lr * u; no bias correction. Schedule: lr * s(k / T) with
s(x) = x / w for x < w, else 0.5 (1 + cos(pi x)), k = steps already taken.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gare.checkpoint import load_tree, read_checkpoint, save_tree
from gare_train.cli import main as train_cli
from gare_train.optim import BertAdam, bert_warmup_cosine, bert_warmup_cosine_lambda


def _param(values, grad=None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))
    if grad is not None:
        p.grad = torch.tensor(grad, dtype=torch.float64)
    return p


def _close(actual, expected, tol=1e-12) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# ---------------------------------------------------------------- the step, by hand
def test_one_and_two_steps_match_hand_computed_values():
    # p = [1, -2], g = [0.5, 0.1]; lr 0.1, b1 0.9, b2 0.96 (sqrt(1 - b2) = 0.2), eps 0, wd 0.1, no clipping
    p = _param([1.0, -2.0], [0.5, 0.1])
    opt = BertAdam([p], lr=0.1, betas=(0.9, 0.96), eps=0.0, weight_decay=0.1, max_grad_norm=-1)
    opt.step()
    st = opt.state[p]
    _close(st["exp_avg"], [0.05, 0.01])  # m1 = 0.1 g
    _close(st["exp_avg_sq"], [0.01, 0.0004])  # v1 = 0.04 g^2, sqrt = [0.1, 0.02]
    # u1 = m1 / sqrt(v1) + wd p = [0.5, 0.5] + [0.1, -0.2] = [0.6, 0.3]; p1 = p - 0.1 u1
    _close(p.data, [0.94, -2.03])
    assert st["step"] == 1

    p.grad = torch.tensor([0.5, 0.1], dtype=torch.float64)  # the same gradient again
    opt.step()
    # m2 = 0.9 m1 + 0.1 g = [0.095, 0.019]; v2 = 0.96 v1 + 0.04 g^2 = [0.0196, 0.000784], sqrt = [0.14, 0.028]
    _close(st["exp_avg"], [0.095, 0.019])
    _close(st["exp_avg_sq"], [0.0196, 0.000784])
    # u2 = m2 / sqrt(v2) + wd p1 = [19/28 + 0.094, 19/28 - 0.203]; p2 = p1 - 0.1 u2
    _close(p.data, [0.94 - 0.1 * (19 / 28 + 0.094), -2.03 - 0.1 * (19 / 28 - 0.203)])
    assert st["step"] == 2
    assert p.grad.tolist() == [0.5, 0.1]  # the optimizer leaves the gradient as it was


def test_no_bias_correction_unlike_adamw():
    """Adam's first step is lr * sign(g) (m / (1 - b1) over sqrt(v / (1 - b2))); BertAdam's is
    lr * (1 - b1) / sqrt(1 - b2) * sign(g) = 0.5 lr sign(g) for b1 0.9, b2 0.96."""
    p, q = _param([1.0, -2.0], [0.5, 0.1]), _param([1.0, -2.0], [0.5, 0.1])
    BertAdam([p], lr=0.1, betas=(0.9, 0.96), eps=0.0, weight_decay=0.0, max_grad_norm=-1).step()
    torch.optim.AdamW([q], lr=0.1, betas=(0.9, 0.96), eps=0.0, weight_decay=0.0).step()
    _close(p.data, [1.0 - 0.05, -2.0 - 0.05])
    _close(q.data, [1.0 - 0.1, -2.0 - 0.1])
    # with decay: AdamW shrinks p by (1 - lr wd) before its step, BertAdam adds wd p to the update; the same
    # decoupled form (lr * wd * p), so only the bias correction separates them
    p, q = _param([1.0, -2.0], [0.5, 0.1]), _param([1.0, -2.0], [0.5, 0.1])
    BertAdam([p], lr=0.1, betas=(0.9, 0.96), eps=0.0, weight_decay=0.1, max_grad_norm=-1).step()
    torch.optim.AdamW([q], lr=0.1, betas=(0.9, 0.96), eps=0.0, weight_decay=0.1).step()
    _close(p.data, [1.0 - 0.1 * (0.5 + 0.1), -2.0 - 0.1 * (0.5 - 0.2)])
    _close(q.data, [1.0 * 0.99 - 0.1, -2.0 * 0.99 - 0.1])


def test_eps_is_added_to_the_square_root():
    # g = 0.5, b2 0.96: sqrt(v) = 0.1; u = 0.05 / (0.1 + 0.1) = 0.25 (inside the root it would be 0.1508)
    p = _param([1.0], [0.5])
    BertAdam([p], lr=1.0, betas=(0.9, 0.96), eps=0.1, weight_decay=0.0, max_grad_norm=-1).step()
    _close(p.data, [0.75])


def test_each_tensor_is_clipped_alone_before_the_moments():
    a = _param([0.0, 0.0], [3.0, 4.0])  # norm 5 > 1: scaled to [0.6, 0.8] first
    b = _param([0.0, 0.0], [0.3, 0.4])  # norm 0.5 <= 1: untouched (a global clip of the two would scale it)
    opt = BertAdam([a, b], lr=0.1, betas=(0.9, 0.96), eps=0.0, weight_decay=0.0, max_grad_norm=1.0)
    opt.step()
    _close(opt.state[a]["exp_avg"], [0.06, 0.08], tol=1e-7)  # 0.1 * [0.6, 0.8] (the clip divides by 5 + 1e-6)
    _close(opt.state[a]["exp_avg_sq"], [0.0144, 0.0256], tol=1e-7)  # 0.04 * [0.36, 0.64]
    _close(opt.state[b]["exp_avg"], [0.03, 0.04])
    _close(opt.state[b]["exp_avg_sq"], [0.0036, 0.0064])
    assert a.grad.tolist() == [3.0, 4.0]
    # torch.nn.utils.clip_grad_norm_ applied to that tensor on its own
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    ref = _param([0.0, 0.0], g.tolist())
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.testing.assert_close(opt.state[a]["exp_avg"], 0.1 * ref.grad, atol=1e-16, rtol=0)
    # a second step shows it in the update too: the clipped history weighs less against a small new gradient
    a.grad = torch.tensor([0.6, 0.8], dtype=torch.float64)
    b.grad = None  # no gradient: no update, no state change
    opt.step()
    _close(opt.state[a]["exp_avg"], [0.9 * 0.06 + 0.06, 0.9 * 0.08 + 0.08], tol=1e-7)
    assert opt.state[b]["step"] == 1 and b.data.tolist() == pytest.approx([-0.05, -0.05])


def test_invalid_arguments_are_refused():
    p = _param([1.0])
    for kw in ({"lr": -1.0}, {"betas": (1.0, 0.9)}, {"betas": (0.9, -0.1)}, {"eps": -1.0}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError):
            BertAdam([p], **kw)
    with pytest.raises(ValueError, match="warmup_proportion"):
        bert_warmup_cosine_lambda(100, 1.0)
    with pytest.raises(ValueError, match="total_steps"):
        bert_warmup_cosine_lambda(0, 0.1)


# ---------------------------------------------------------------- the schedule
def test_schedule_values_at_warmup_start_end_middle_and_end():
    w = 0.1
    assert bert_warmup_cosine(0.0, w) == 0.0  # warm-up start: the first step runs at lr 0
    assert bert_warmup_cosine(0.05, w) == pytest.approx(0.5)  # half-way through the warm-up
    assert bert_warmup_cosine(0.099, w) == pytest.approx(0.99)  # last warm-up value
    # warm-up end: the cosine of the whole progress, so the factor drops to 0.5 (1 + cos(0.1 pi)) = 0.97553
    assert bert_warmup_cosine(0.1, w) == pytest.approx(0.5 * (1 + math.cos(0.1 * math.pi))) == pytest.approx(0.975528, abs=1e-6)
    assert bert_warmup_cosine(0.5, w) == pytest.approx(0.5)  # middle of training
    assert bert_warmup_cosine(1.0, w) == pytest.approx(0.0, abs=1e-15)  # end of training

    # as a LambdaLR on BertAdam: the lr each step uses is lr * s(k / T), k the steps already taken
    p = _param([1.0])
    opt = BertAdam([p], lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, bert_warmup_cosine_lambda(100, w))
    used = []
    for _ in range(100):
        used.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    assert used[0] == 0.0 and used[5] == pytest.approx(2.0 * 0.5) and used[9] == pytest.approx(2.0 * 0.9)
    assert used[10] == pytest.approx(2.0 * 0.5 * (1 + math.cos(0.1 * math.pi)))
    assert used[50] == pytest.approx(1.0)
    assert used[99] == pytest.approx(2.0 * 0.5 * (1 + math.cos(0.99 * math.pi)))
    # the project's own warm-up cosine (AdamW) is another curve: (k + 1) / W, then cosine after the warm-up
    from gare_train.optim import warmup_cosine

    ours = warmup_cosine(100, w)
    assert ours(0) == pytest.approx(0.1) and ours(10) == pytest.approx(1.0) and ours(55) == pytest.approx(0.5)


def test_bertadam_with_lambdalr_equals_the_reference_loop():
    """A plain restatement of the reference's step, whose schedule lives inside the optimizer (progress =
    the tensor's step count / t_total), against BertAdam driven by LambdaLR, over a whole 40-step run."""
    torch.manual_seed(0)
    T, w, lr, b1, b2, eps, wd, max_norm = 40, 0.1, 0.05, 0.9, 0.98, 1e-6, 0.2, 1.0
    grads = [torch.randn(3, 4, dtype=torch.float64) * (0.1 if k % 3 else 3.0) for k in range(T)]
    x0 = torch.randn(3, 4, dtype=torch.float64)

    x, m, v = x0.clone(), torch.zeros_like(x0), torch.zeros_like(x0)
    for k, g in enumerate(grads):
        g = g * min(1.0, max_norm / (float(g.norm()) + 1e-6))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = m / (v.sqrt() + eps) + wd * x
        s = k / T / w if k / T < w else 0.5 * (1 + math.cos(math.pi * k / T))
        x = x - lr * s * u

    p = torch.nn.Parameter(x0.clone())
    opt = BertAdam([{"params": [p], "weight_decay": wd}], lr=lr, betas=(b1, b2), eps=eps, max_grad_norm=max_norm)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, bert_warmup_cosine_lambda(T, w))
    for g in grads:
        p.grad = g.clone()
        opt.step()
        sched.step()
    torch.testing.assert_close(p.data, x, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- state and resume
def _two_params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def _grads(k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(4, 3, generator=g) * 2.0, torch.randn(3, generator=g) * 0.1]


def _make(params):
    opt = BertAdam([{"params": [params[0]], "weight_decay": 0.2}, {"params": [params[1]], "weight_decay": 0.0}],
                   lr=1e-2, betas=(0.9, 0.98), eps=1e-6, max_grad_norm=1.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, bert_warmup_cosine_lambda(10, 0.1))


def _step(params, opt, sched, k):
    for p, g in zip(params, _grads(k), strict=True):
        p.grad = g
    opt.step()
    sched.step()


def test_state_dict_round_trip_and_resume_equal_an_uninterrupted_run(tmp_path):
    a = _two_params(0)
    opt_a, sched_a = _make(a)
    for k in range(3):
        _step(a, opt_a, sched_a, k)

    b = _two_params(0)
    opt_b, sched_b = _make(b)
    _step(b, opt_b, sched_b, 0)
    _step(b, opt_b, sched_b, 1)
    save_tree(tmp_path / "state.safetensors", {"optimizer": opt_b.state_dict(), "scheduler": sched_b.state_dict(),
                                               "params": [p.detach() for p in b]})
    state = load_tree(tmp_path / "state.safetensors")
    c = [torch.nn.Parameter(t.clone()) for t in state["params"]]
    opt_c, sched_c = _make(c)
    opt_c.load_state_dict(state["optimizer"])
    sched_c.load_state_dict(state["scheduler"])
    assert opt_c.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] > 0
    for pc, pb in zip(c, b, strict=True):
        assert opt_c.state[pc]["step"] == 2
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_c.state[pc][key], opt_b.state[pb][key], atol=0, rtol=0)
    _step(c, opt_c, sched_c, 2)
    for pa, pc in zip(a, c, strict=True):
        torch.testing.assert_close(pc.data, pa.data, atol=0, rtol=0)
        torch.testing.assert_close(opt_c.state[pc]["exp_avg_sq"], opt_a.state[pa]["exp_avg_sq"], atol=0, rtol=0)


# ---------------------------------------------------------------- the trainer and the CLI
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from gare_train.synth import SynthConfig, generate_corpus

    root = tmp_path_factory.mktemp("synth")
    generate_corpus(root, SynthConfig(n_videos=12, seed=5, width=64, height=64, duration=2.0, fps=6), progress=False)
    return root


def _cfg(corpus: Path, out: Path, **kw):
    from gare_train.fit import TrainConfig

    return TrainConfig(model="gare-test-tiny", data={"kind": "synth", "root": str(corpus)}, out_dir=str(out),
                       epochs=2, batch_size=4, num_workers=0, lr=1e-3, **kw)


def test_config_default_stays_adamw_and_bertadam_is_built_on_request(corpus, tmp_path):
    from gare_train.fit import TrainConfig, Trainer

    assert TrainConfig().optimizer == "adamw"
    assert "optimizer" not in TrainConfig().fingerprint()  # states saved before the option still resume
    assert TrainConfig(optimizer="bertadam").fingerprint()["optimizer"] == "bertadam"
    with pytest.raises(ValueError, match="optimizer must be one of adamw, bertadam"):
        TrainConfig(optimizer="sgd")
    assert isinstance(Trainer(_cfg(corpus, tmp_path / "a"), progress=False).optimizer, torch.optim.AdamW)

    tr = Trainer(_cfg(corpus, tmp_path / "b", optimizer="bertadam"), progress=False)
    opt = tr.optimizer
    assert isinstance(opt, BertAdam)
    groups = {g["name"]: g for g in opt.param_groups}
    assert groups["clip-decay"]["weight_decay"] == 0.2 and groups["clip-no_decay"]["weight_decay"] == 0.0
    assert groups["clip-decay"]["initial_lr"] == pytest.approx(1e-3 * 1e-3) and groups["new-decay"]["initial_lr"] == 1e-3
    assert all(g["betas"] == (0.9, 0.98) and g["eps"] == 1e-6 and g["max_grad_norm"] == 1.0 for g in opt.param_groups)
    assert all(p.ndim < 2 for p in groups["new-no_decay"]["params"] + groups["clip-no_decay"]["params"])
    # the reference schedule: the first step at lr 0, so it moves nothing but fills the moments
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    batch = next(iter(tr._loader(0, 0)))
    assert tr.optimizer.param_groups[0]["lr"] == 0.0
    tr.train_step(batch)
    for k, v in tr.model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0, msg=k)
    assert any(float(s["exp_avg"].abs().sum()) > 0 for s in opt.state.values())
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 1e-3 * bert_warmup_cosine(1 / tr.total_steps, 0.1))


def test_gare_train_fit_optimizer_bertadam_runs_real_steps(corpus, tmp_path):
    out = tmp_path / "run"
    assert train_cli(["fit", "--model", "gare-test-tiny", "--synth", str(corpus), "--out", str(out), "--epochs", "2",
                      "--batch-size", "4", "--num-workers", "0", "--lr", "1e-3", "--no-progress",
                      "--optimizer", "bertadam", "--max-steps", "3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    ck = read_checkpoint(out / "last.safetensors")
    assert ck.train_args["optimizer"] == "bertadam"
    state = load_tree(out / "last.state.safetensors")
    per_param = state["optimizer"]["state"]
    assert per_param and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} and s["step"] == 3 for s in per_param.values())
    assert state["scheduler"]["last_epoch"] == 3
    from gare_train.fit import Trainer

    init = Trainer(_cfg(corpus, tmp_path / "init", optimizer="bertadam"), progress=False).model.state_dict()
    moved = [k for k, v in ck.state_dict.items() if not torch.equal(v, init[k])]
    assert moved, "three steps (the first at lr 0) left every weight where it started"
    # resuming the run with the other optimizer is refused (the fingerprint names it)
    from gare.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="different configuration.*optimizer"):
        Trainer(_cfg(corpus, out), resume=str(out / "last.safetensors"), progress=False)
