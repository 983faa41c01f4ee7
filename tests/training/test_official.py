"""Importing a checkpoint in the authors' layout: every tensor accounted for, identical pair scores.

The test builds an official-layout state dict itself (random weights of the tiny sizes) and scores it with
an independent re-statement of the reference forward pass written against the official key names.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gare.backbone import open_clip_module
from gare.checkpoint import load_model
from gare_train.authors_checkpoint import convert_official_state_dict
from gare_train.cli import main as train_cli

D, FRAMES, WORDS, TEMP = 64, 6, 16, 3.0


def official_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # open_clip initialises from the global generator: seed it too, or every run tests other weights (a flaky
    # tolerance is then a lottery over checkpoints, not a property of the code)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = open_clip_module().create_model("gare-test-tiny", pretrained=None, force_quick_gelu=True)
    sd = {}
    for k, v in clip.state_dict().items():
        noise = torch.randn(v.shape, generator=g) * (0.02 if v.ndim > 1 else 0.05)
        sd[f"clip.{k}"] = v + noise
    sd["clip.logit_scale"] = torch.tensor(math.log(1 / 0.07))
    sd["frame_position_embeddings.weight"] = torch.randn(WORDS, D, generator=g) * 0.1
    for i in range(2):
        for k, v in clip.transformer.resblocks[i].state_dict().items():
            sd[f"transformerClip.resblocks.{i}.{k}"] = v + torch.randn(v.shape, generator=g) * 0.05

    def lin(name, dout=D, din=D, std=0.2):
        sd[f"{name}.weight"] = torch.randn(dout, din, generator=g) * std
        sd[f"{name}.bias"] = torch.randn(dout, generator=g) * 0.05

    def ln(name):
        sd[f"{name}.weight"] = 1 + torch.randn(D, generator=g) * 0.1
        sd[f"{name}.bias"] = torch.randn(D, generator=g) * 0.1

    base = "psi.layers.0"
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        lin(f"{base}.cross_attn.{p}")
    lin(f"{base}.linear1")
    lin(f"{base}.linear2")
    lin(f"{base}.mlp.0", 4 * D, D)
    lin(f"{base}.mlp.2", D, 4 * D)
    for n in ("layer_norm1", "layer_norm2", "layer_norm3"):
        ln(f"{base}.{n}")
    lin("psi.mean_proj")
    lin("psi.log_std_proj")
    for k in [k for k in sd if k.startswith("psi.")]:
        sd[f"agent.{k}"] = sd[k].clone()
    lin("weight_fc.0", 4 * D, 2 * D)
    lin("weight_fc.2", 1, 4 * D)
    return sd


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def reference_scores(sd, tokens, frames, mask=None) -> torch.Tensor:
    """The authors' forward pass (eval mode), restated on their key names. With `mask` (b, f) padded rows are
    what their loader gives (zero pixels) and what their model does with them: masked only inside the
    temporal transformer's attention and after the pooling softmax; v̄ averages all f rows and psi attends
    over all rows."""
    t, Fv = reference_encode(sd, tokens, frames, mask)
    return reference_pair_scores(sd, t, Fv, mask)


def reference_encode(sd, tokens, frames, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of `reference_scores`: text embeddings t (a, d) and frame features Fv (b, f, d), padded
    rows included (what the authors' model computes for them)."""
    clip_sd = {k[5:]: v for k, v in sd.items() if k.startswith("clip.")}
    # open_clip infers the architecture from the OpenAI layout on its own; it stores fp16, so reload in fp32.
    clip = open_clip_module().model.build_model_from_openai_state_dict(dict(clip_sd), quick_gelu=True, cast_dtype=torch.float32)
    clip = clip.float().eval()
    clip.load_state_dict(clip_sd)
    t = clip.encode_text(tokens)  # context length 16 == max_words: the reference's 32-word case in miniature
    b, f = frames.shape[:2]
    x0 = clip.encode_image(frames.flatten(0, 1)).view(b, f, -1)

    if mask is None:
        mask = torch.ones(b, f)
    key_bias = (1.0 - mask.float())[:, None, :] * -1e6  # (b, 1, f): their extended video mask

    x = x0 + sd["frame_position_embeddings.weight"][:f]
    for i in range(2):
        p = f"transformerClip.resblocks.{i}."
        h = F.layer_norm(x, (D,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"])
        qkv = h @ sd[p + "attn.in_proj_weight"].T + sd[p + "attn.in_proj_bias"]
        q, k, v = qkv.chunk(3, dim=-1)  # one head: width 64 // 64
        w = (q @ k.transpose(1, 2) / math.sqrt(D) + key_bias).softmax(-1)
        x = x + (w @ v) @ sd[p + "attn.out_proj.weight"].T + sd[p + "attn.out_proj.bias"]
        h = F.layer_norm(x, (D,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])
        x = x + _qgelu(h @ sd[p + "mlp.c_fc.weight"].T + sd[p + "mlp.c_fc.bias"]) @ sd[p + "mlp.c_proj.weight"].T + sd[p + "mlp.c_proj.bias"]
    Fv = x + x0  # (b, f, d)
    return t, Fv


def reference_pair_scores(sd, t, Fv, mask=None, vbar=None) -> torch.Tensor:
    """The second half of `reference_scores`: psi and the pooled cosine for every (text, video) pair from
    t (a, d) and Fv (b, f, d). v̄ is Fv's mean over all f rows unless `vbar` (b, d) is given (an index
    stores v̄ in float32 beside float16 frames)."""
    b, f = Fv.shape[:2]
    if mask is None:
        mask = torch.ones(b, f)
    P = "psi.layers.0."

    def L(name, z):
        return z @ sd[name + ".weight"].T + sd[name + ".bias"]

    def N(name, z):
        return F.layer_norm(z, (D,), sd[name + ".weight"], sd[name + ".bias"])

    scores = torch.empty(t.shape[0], b)
    for i in range(t.shape[0]):
        for j in range(b):
            gap = N(P + "layer_norm1", (Fv[j].mean(0) if vbar is None else vbar[j]) - t[i])
            C = N(P + "layer_norm1", Fv[j])
            att = (L(P + "cross_attn.k_proj", C) @ L(P + "cross_attn.q_proj", gap) / math.sqrt(D)).softmax(0)
            A = N(P + "layer_norm2", L(P + "cross_attn.out_proj", att @ L(P + "cross_attn.v_proj", C)))
            Out = N(P + "layer_norm3", A + L(P + "linear1", A))
            delta = L("psi.mean_proj", Out)
            pw = (Fv[j] @ t[i] / TEMP).softmax(0) * mask[j]  # softmax over all rows, then the mask
            pooled = pw @ Fv[j]
            scores[i, j] = F.cosine_similarity(t[i] + delta, pooled, dim=0)
    return scores


def test_every_tensor_mapped_or_dropped():
    sd = official_state_dict()
    new_sd, report = convert_official_state_dict(sd, max_frames=FRAMES, max_words=WORDS)
    assert set(report.mapped) | set(report.dropped) == set(sd)
    assert not set(report.mapped) & set(report.dropped)
    assert report.config.backbone == "gare-test-tiny"
    assert report.config.temporal_layers == 2 and report.config.embed_dim == D
    assert all(k.startswith("agent.") or "linear2" in k or ".mlp." in k or k.startswith("weight_fc.") for k in report.dropped)
    assert new_sd["psi.mu.weight"].equal(sd["psi.mean_proj.weight"])


def test_unknown_or_inconsistent_tensors_are_refused():
    sd = official_state_dict()
    sd["mystery.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="mystery.weight"):
        convert_official_state_dict(sd)
    sd = official_state_dict()
    sd["agent.psi.mean_proj.weight"] += 1
    with pytest.raises(ValueError, match="differs"):
        convert_official_state_dict(sd)


@torch.no_grad()
def test_imported_model_scores_equal_reference(tmp_path):
    sd = official_state_dict()
    src = tmp_path / "pytorch_model.bin.4"
    torch.save({f"module.{k}": v for k, v in sd.items()}, src)  # as saved from a DDP-wrapped model
    out = tmp_path / "gare.safetensors"
    assert train_cli(["import-official", str(src), str(out), "--max-frames", str(FRAMES), "--max-words", str(WORDS)]) == 0
    model, ckpt = load_model(out)
    assert ckpt.info["imported_from"] == str(src)

    g = torch.Generator().manual_seed(3)
    captions = ["a man is playing guitar", "a woman cooks pasta in a kitchen", "cars race on a track"]
    tokens = open_clip_module().get_tokenizer("gare-test-tiny")(captions)
    frames = torch.randn(4, FRAMES, 3, 32, 32, generator=g)
    ref = reference_scores(sd, tokens, frames)

    t = model.encode_text(model.tokenize(captions))
    Fv, vbar = model.encode_video(frames, torch.ones(4, FRAMES, dtype=torch.long))
    ours = model.score(t, Fv, torch.ones(4, FRAMES, dtype=torch.long))
    assert (ref - ref.mean()).abs().max() > 1e-3  # not a degenerate comparison
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_imported_model_scores_padded_clips_as_the_authors(tmp_path):
    """Short clips: an imported checkpoint keeps the padded rows' features, averages them into v̄ and lets
    psi attend to them, exactly as the reference; a model with masked padding would score them differently."""
    sd = official_state_dict(seed=1)
    src = tmp_path / "pytorch_model.bin.2"
    torch.save(sd, src)
    out = tmp_path / "gare.safetensors"
    assert train_cli(["import-official", str(src), str(out), "--max-frames", str(FRAMES), "--max-words", str(WORDS)]) == 0
    model, ckpt = load_model(out)
    assert ckpt.config.reference_padding is True

    g = torch.Generator().manual_seed(5)
    captions = ["a dog jumps over a fence", "two people dance", "a red car turns left", "someone slices bread"]
    tokens = open_clip_module().get_tokenizer("gare-test-tiny")(captions)
    real = [FRAMES, 4, 2, 1]  # the first clip is full length, the others padded
    mask = torch.zeros(len(real), FRAMES, dtype=torch.long)
    frames = torch.randn(len(real), FRAMES, 3, 32, 32, generator=g)
    for j, n in enumerate(real):
        mask[j, :n] = 1
        frames[j, n:] = 0.0  # the authors' loader leaves padded frames as zero pixels
    ref = reference_scores(sd, tokens, frames, mask)

    t = model.encode_text(model.tokenize(captions))
    Fv, vbar = model.encode_video(frames, mask)
    assert Fv[1:, -1].abs().sum() > 0  # padded rows keep their features (an index must store them)
    torch.testing.assert_close(vbar, Fv.mean(1))
    ours = model.score(t, Fv, mask)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.score(t, Fv, mask, vbar=vbar), ref, atol=1e-5, rtol=0)

    # The same weights with masked padding (what models trained here do) differ on the padded clips only.
    from gare.model import GARE

    masked = GARE.build(ckpt.config.replace(reference_padding=False), pretrained="none").eval()
    masked.load_state_dict(ckpt.state_dict)
    Fm, _ = masked.encode_video(frames, mask)
    sm = masked.score(t, Fm, mask)
    torch.testing.assert_close(sm[:, 0], ref[:, 0], atol=1e-5, rtol=0)
    assert (sm[:, 1:] - ref[:, 1:]).abs().max() > 1e-3
