"""A shard replica holds psi alone (gare_serve.ray_serve.shard_replica.load_shard_model over
gare.checkpoint.read_checkpoint_subset), not the whole GARE model: its parameters exclude the CLIP towers and the
temporal transformer, the Ray deployment's constructor loads that, and its answers equal a shard worker's with the
full model. No Ray here: the deployment's class is called directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gare.checkpoint import CheckpointError, load_model, read_checkpoint, read_checkpoint_subset
from gare_build.build import BuildOptions
from gare_build.shard_build import build_sharded
from gare_search import query as Q
from gare_search import search as S
from gare_serve.ray_serve import deployment as ray_app
from gare_serve.ray_serve.shard_replica import ShardModel, ShardWorker, load_shard_model


@pytest.fixture(scope="module")
def env(service_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("shard-model") / "INDEX"
    build_sharded(str(service_env["checkpoint"]), str(service_env["videos"]), root,
                  BuildOptions(workers=0, progress=False, index_type="flat", ncl_stage1=True), n_shards=2)
    return root, service_env["checkpoint"], service_env["captions"]


def test_subset_reads_only_the_asked_tensors(env):
    _, ckpt, _ = env
    full = read_checkpoint(ckpt)
    sub = read_checkpoint_subset(ckpt, ("psi.",))
    psi_keys = sorted(k for k in full.state_dict if k.startswith("psi."))
    assert sorted(sub.state_dict) == psi_keys and sub.queues == {}
    assert sub.config == full.config and len(full.state_dict) > len(psi_keys)
    for k in psi_keys:
        torch.testing.assert_close(sub.state_dict[k], full.state_dict[k], rtol=0, atol=0)
    with pytest.raises(CheckpointError, match=r"no model tensor starts with \['nothing\.'\]"):
        read_checkpoint_subset(ckpt, ("nothing.",))


def test_shard_model_holds_psi_alone(env):
    _, ckpt, _ = env
    light = load_shard_model(ckpt)
    full, _ = load_model(ckpt, "cpu")
    names = [n for n, _ in light.named_parameters()]
    assert names and all(n.startswith("psi.") for n in names)
    assert not any(n.startswith(("clip.", "temporal.")) for n in names)
    n_light = sum(p.numel() for p in light.parameters())
    assert n_light == sum(p.numel() for p in full.psi.parameters())
    assert n_light < sum(p.numel() for p in full.parameters()) / 2  # the towers are most of the model
    for (a, p), (b, q) in zip(light.psi.state_dict().items(), full.psi.state_dict().items(), strict=True):
        assert a == b
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert not light.training and light.device == full.device and light.cfg == full.cfg


def test_ray_shard_replica_loads_the_light_model(env, monkeypatch):
    """The deployment's constructor (what each Ray replica runs) holds a ShardModel, and still checks the
    checkpoint's sha256 against the index (a different file is refused)."""
    root, ckpt, _ = env
    from gare_search import rerank

    for k in ("GARE_INDEX", "GARE_CHECKPOINT", "GARE_DEVICE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("GARE_RERANK_DEVICE", "cpu")  # the replica follows the service's setting
    server = ray_app.ShardServer.func_or_class(str(root), 1, str(ckpt))
    try:
        assert isinstance(server.worker.model, ShardModel)
        assert server.worker.rerank_settings == rerank.RerankSettings(device="cpu")
        assert server.call("open", 1)
    finally:
        server.worker.close()
    other = ckpt.parent / "other.safetensors"
    m, _ = load_model(ckpt, "cpu")
    with torch.no_grad():
        m.psi.q.weight.add_(0.01)
    from gare.checkpoint import save_checkpoint

    save_checkpoint(other, m)
    with pytest.raises(Exception, match="sha256"):
        ray_app.ShardServer.func_or_class(str(root), 0, str(other))


def test_light_candidates_equal_the_full_models(env):
    root, ckpt, captions = env
    full, _ = load_model(ckpt, "cpu")
    light = load_shard_model(ckpt)
    t = Q.encode_queries(full, captions[:6]).numpy()  # the ingress's query vectors
    opts = [S.SearchOptions(k=5, candidates=6, ncl=True), S.SearchOptions(k=4, candidates=8, ncl=False),
            S.SearchOptions(k=3, candidates=5, ncl=True, ncl_stage1=True), S.SearchOptions(k=4, candidates=6, rerank=False),
            S.SearchOptions(k=5, candidates=6), S.SearchOptions(k=16, candidates=16)]
    for s in range(2):
        a, b = ShardWorker(root, s, full), ShardWorker(root, s, light)
        try:
            want, got = a.candidates(1, t, opts), b.candidates(1, t, opts)
            for w, g in zip(want, got, strict=True):
                np.testing.assert_array_equal(g.ids, w.ids)
                np.testing.assert_array_equal(g.ann, w.ann)
                np.testing.assert_array_equal(g.bias, w.bias)
                assert (g.psi is None) == (w.psi is None)
                if w.psi is not None:
                    assert w.psi.size and np.abs(w.psi).max() > 0
                    np.testing.assert_allclose(g.psi, w.psi, rtol=0, atol=1e-6)
        finally:
            a.close()
            b.close()


def test_ray_shard_replica_checks_its_files_before_serving(env, monkeypatch, tmp_path):
    """The deployment's constructor opens its shard with the fast-hash check (GARE_INDEX_CHECK, default on): a file
    of the shard altered in place at the same size is refused naming it; with the check off it opens."""
    import shutil

    from gare_index.shards import current_generation, shard_root
    from gare_index.store import IndexFormatError

    root = shutil.copytree(env[0], tmp_path / "INDEX", symlinks=True)
    ckpt = env[1]
    for k in ("GARE_INDEX", "GARE_CHECKPOINT", "GARE_DEVICE", "GARE_INDEX_CHECK"):
        monkeypatch.delenv(k, raising=False)
    gen = current_generation(root)
    units = shard_root(root, 1) / "versions" / gen.versions[1] / "units.npy"
    data = bytearray(units.read_bytes())
    data[-1] ^= 0x01  # one bit of the last vector: same size, same header
    units.unlink()  # its own inode: the other versions' hard links keep the good bytes
    units.write_bytes(bytes(data))
    with pytest.raises(IndexFormatError, match="units.npy"):
        ray_app.ShardServer.func_or_class(str(root), 1, str(ckpt))
    monkeypatch.setenv("GARE_INDEX_CHECK", "off")
    server = ray_app.ShardServer.func_or_class(str(root), 1, str(ckpt))
    try:
        assert server.call("open", gen.number)
    finally:
        server.worker.close()
