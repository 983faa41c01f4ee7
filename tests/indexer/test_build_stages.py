"""The build's encode loop (gare_build.pipeline.encode): the overlapped loop (batch n on the device while batch n + 1
is fetched and batch n - 1 written by a thread) stores exactly the features of a plain decode -> normalise ->
encode -> float16 loop over the same batches, its time accounting adds up, a failed cache write fails the run, and
``--workers auto`` resolves by device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gare.checkpoint import file_sha256, load_model
from gare.video import normalize_frames
from gare.video_loader import decode_batch_size, iter_decoded
from gare_build.cli_parser import build_parser
from gare_build.pipeline.encode import Encoder
from gare_build.pipeline.options import BuildOptions, RunReport, auto_decode_workers
from gare_build.resumable_work import WorkCache


def reference_features(model, jobs, batch: int, device: torch.device) -> dict[str, tuple[np.ndarray, ...]]:
    """key -> (frames float16 (f, d), vbar float32 (d,), mask uint8 (f,)): one synchronous op after another, in
    this process, the same batches the encoder sees."""
    cfg = model.cfg
    out: dict[str, tuple[np.ndarray, ...]] = {}
    for b in iter_decoded(jobs, max_frames=cfg.max_frames, framerate=cfg.video_framerate, image_size=cfg.image_size,
                          batch_size=batch, num_workers=0, as_uint8=True):
        with torch.no_grad():
            frames = normalize_frames(b["frames"].to(device), b["mask"])
            feats, vbar = model.encode_video(frames, b["mask"])
        feats, vbar = feats.float().cpu().numpy(), vbar.float().cpu().numpy()
        for i, k in enumerate(b["keys"]):
            out[k] = (feats[i].astype(np.float16), vbar[i], b["mask"][i].numpy().astype(np.uint8))
    return out


def run_encoder(tmp: Path, ckpt: Path, jobs, opts: BuildOptions, device: torch.device, cache: WorkCache | None = None):
    model, _ = load_model(ckpt, device)
    cache = cache or WorkCache(tmp / "work", "k")
    report = RunReport(command="build", index=str(tmp))
    enc = Encoder(cache=cache, report=report, opts=opts, progress=False)
    enc.run(jobs, model=model, device=device, precision="fp32", checkpoint=str(ckpt), sha256=file_sha256(ckpt))
    return model, cache, report, enc


def cached(cache: WorkCache) -> dict[str, tuple[np.ndarray, ...]]:
    out = {}
    for k, (path, row) in cache.index().items():
        s = cache.load(path)
        out[k] = (s.frames[row], s.vbar[row], s.masks[row])
    return out


def assert_same_bits(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        for g, w in zip(got[k], want[k], strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes(), k


def jobs_of(corpus: Path) -> list[tuple[str, str, None, None]]:
    return [(p.name, str(p), None, None) for p in sorted(corpus.glob("*.mp4"))]


def test_overlapped_loop_stores_the_plain_loops_bits_and_accounts_its_time(tmp_path, ckpt, corpus):
    jobs = jobs_of(corpus)
    opts = BuildOptions(batch_size=4, workers=2, progress=False)
    batch = decode_batch_size(len(jobs), opts.batch_size, opts.workers)
    model, cache, report, enc = run_encoder(tmp_path, ckpt, jobs, opts, torch.device("cpu"))
    want = reference_features(model, jobs, batch, torch.device("cpu"))
    assert_same_bits(cached(cache), want)
    assert report.encoded == len(jobs) and report.frames_encoded == sum(int(w[2].sum()) for w in want.values())

    st = report.encode_stages
    assert st is not None and st == enc.stages.to_dict()
    assert st["batches"] == -(-len(jobs) // batch) and st["videos"] == len(jobs)
    assert st["frames"] == report.frames_encoded and st["workers"] == 2 and st["timed_on"] == "cpu"
    # the parts: every one measured, none longer than the loop; the workers' own clocks came with the batches
    assert 0 < st["first_batch_s"] <= st["wait_s"] <= st["loop_s"]
    assert st["encode_s"] > 0 and st["write_s"] > 0 and st["device_s"] <= st["loop_s"]
    assert st["decode_s"] > 0 and 0 < st["decode_cpu_s"] and st["decode_frames_per_s_per_worker"] > 0
    assert st["decode_frames_per_s_all_workers"] == pytest.approx(2 * st["decode_frames_per_s_per_worker"], rel=1e-3)
    assert "waiting for decoded batches" in report.summary() and "frames/s per worker x 2" in report.summary()


def test_in_process_decoding_keeps_the_bits_too(tmp_path, ckpt, corpus):
    jobs = jobs_of(corpus)[:5]
    opts = BuildOptions(batch_size=2, workers=0, progress=False)
    model, cache, report, _ = run_encoder(tmp_path, ckpt, jobs, opts, torch.device("cpu"))
    assert_same_bits(cached(cache), reference_features(model, jobs, 2, torch.device("cpu")))
    st = report.encode_stages
    assert st["batches"] == 3 and st["decode_s"] == 0 and st["decode_frames_per_s_per_worker"] is None  # no workers


class FailingCache(WorkCache):
    """A work cache whose disk fills up at the second batch."""

    def put(self, shard):
        if self.index():
            raise OSError("No space left on device (test)")
        return super().put(shard)


def test_a_failed_cache_write_fails_the_run(tmp_path, ckpt, corpus):
    jobs = jobs_of(corpus)[:6]
    with pytest.raises(OSError, match="No space left"):
        run_encoder(tmp_path, ckpt, jobs, BuildOptions(batch_size=2, workers=1, progress=False), torch.device("cpu"),
                    cache=FailingCache(tmp_path / "work", "k"))


def test_workers_auto_by_device(monkeypatch):
    assert auto_decode_workers("cpu") == 2  # the encoder needs the cores: as before
    p = build_parser()
    base = ["build", "--checkpoint", "c", "--videos", "v", "--out", "o"]
    assert p.parse_args(base).workers == "auto"
    assert p.parse_args([*base, "--workers", "0"]).workers == 0
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--workers", "-1"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert auto_decode_workers("auto") == 15  # a GPU encodes: every core but the loop's decodes
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert auto_decode_workers("cuda") == 2


def small_videos(dest: Path, n: int = 12) -> Path:
    """n small mp4 files (32x32, 2 s at 8 fps, a moving block): PyAV's H.264 where PyAV is (tests.indexer.support),
    else OpenCV's MPEG-4 Part 2 (the lent GPU machine has OpenCV and no PyAV)."""
    import importlib.util

    if importlib.util.find_spec("av") is not None:
        from tests.indexer.support import make_corpus

        return make_corpus(dest, n=n)
    import cv2

    out = dest / "videos"
    out.mkdir(parents=True)
    for i in range(n):
        w = cv2.VideoWriter(str(out / f"video{i}.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 8.0, (32, 32))
        assert w.isOpened()
        for t in range(16):
            f = np.full((32, 32, 3), (20 * i + 3 * t) % 255, np.uint8)
            f[(2 * t) % 24:(2 * t) % 24 + 8, (i + t) % 24:(i + t) % 24 + 8] = (255 - 10 * i) % 255
            w.write(f)
        w.release()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlapped_loop_stores_the_plain_loops_bits(tmp_path, ckpt):
    """Pinned memory, non_blocking copies both ways and CUDA-event timing change no bit of what is stored."""
    dev = torch.device("cuda")
    jobs = jobs_of(small_videos(tmp_path / "corpus"))
    opts = BuildOptions(batch_size=4, workers=2, progress=False)
    model, cache, report, _ = run_encoder(tmp_path, ckpt, jobs, opts, dev)
    want = reference_features(model, jobs, decode_batch_size(len(jobs), 4, 2), dev)
    assert_same_bits(cached(cache), want)
    st = report.encode_stages
    assert st["timed_on"] == "cuda events" and st["transfer_s"] > 0 and st["encode_s"] > 0 and st["to_host_s"] > 0
