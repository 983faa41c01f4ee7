"""gare.video and gare.video_loader: reference frame sampling, decoding + CLIP preprocessing, and fault-tolerant batches."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from gare import video as V
from gare import video_loader as VL
from gare_train.synth import write_video
from tests.badfiles import write_bad_videos

FPS = 10.0
N_FRAMES = 47
H, W = 48, 80  # non-square: exercises resize-the-shorter-side and the centre crop


def _level(t: int) -> int:
    return 20 + 4 * t  # every frame has its own brightness, so decoded frames identify their position


def _make_frames(n: int = N_FRAMES, h: int = H, w: int = W) -> np.ndarray:
    frames = np.empty((n, h, w, 3), dtype=np.uint8)
    for t in range(n):
        frames[t] = _level(t)
        x = (3 * t) % (w - 12)
        frames[t, 10:22, x : x + 12] = (250, 30, 30)  # a moving red block: real content for the crop
    return frames


@pytest.fixture(scope="module")
def good_video(tmp_path_factory) -> Path:
    return write_video(tmp_path_factory.mktemp("good") / "good.mp4", _make_frames(), FPS)


@pytest.fixture(scope="module")
def bad_videos(tmp_path_factory) -> dict[str, Path]:
    return write_bad_videos(tmp_path_factory.mktemp("bad"))


@contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging the suite) if the block takes longer than ``seconds``."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"took longer than {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------------------------------
# sample_positions
# --------------------------------------------------------------------------------------------------


def _reference_positions(n, fps, framerate, max_frames, s=None, e=None):
    """A literal transcription of the reference ``_get_rawvideo_dec`` index logic (integer seconds)."""
    if s is None:
        start_time, end_time = None, None
    else:
        start_time, end_time = max(int(s), 0), max(int(e), 0)
        if start_time > end_time:
            start_time, end_time = end_time, start_time
        elif start_time == end_time:
            end_time = start_time + 1
    f_start = 0 if start_time is None else int(start_time * fps)
    f_end = int(min(1000000000 if end_time is None else end_time * fps, n - 1))
    if f_end - f_start + 1 <= 0:
        return []
    t_stride = int(round(float(fps) / int(framerate)))
    all_pos = list(range(f_start, f_end + 1, t_stride))
    if len(all_pos) > max_frames:
        return [all_pos[i] for i in np.linspace(0, len(all_pos) - 1, num=max_frames, dtype=int)]
    return all_pos


@pytest.mark.parametrize(
    "args, expected",
    [
        ((100, 25.0, 1, 12), [0, 25, 50, 75]),
        ((300, 30.0, 1, 4), [0, 90, 180, 270]),  # 10 candidates thinned by linspace(0, 9, 4) = 0,3,6,9
        ((300, 30.0, 1, 12, 2, 5), [60, 90, 120, 150]),
        ((300, 30.0, 1, 12, 5, 2), [60, 90, 120, 150]),  # reversed window is swapped
        ((300, 30.0, 1, 12, 3, 3), [90, 120]),  # empty window becomes [start, start + 1]
        ((300, 30.0, 1, 12, -4, 1), [0, 30]),  # negative times clamp to 0
        ((100, 25.0, 1, 12, 3, 100), [75]),  # window end clipped to the last frame
        ((100, 25.0, 1, 12, 10, 20), []),  # window after the end of the video
        ((300, 30.0, 1, 12, 0.5, 1.5), [15, 45]),  # float seconds
        ((100, 25.0, 2, 100), list(range(0, 100, 12))),  # round(12.5) == 12 (Python rounding, as reference)
        ((20, 8.0, 32, 100), list(range(20))),  # framerate above fps: stride clamps to 1
        ((40, 8.0, 0.5, 100), [0, 16, 32]),  # fractional framerate: one frame every 2 s
        ((1, 30.0, 1, 12), [0]),
        ((0, 30.0, 1, 12), []),
    ],
)
def test_sample_positions_hand_computed(args, expected):
    assert V.sample_positions(*args) == expected


def test_sample_positions_matches_reference_transcription():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 2000))
        fps = float(rng.choice([8.0, 12.5, 23.976, 25.0, 29.97, 30.0, 60.0]))
        framerate = int(rng.integers(1, 6))
        max_frames = int(rng.integers(1, 20))
        if rng.random() < 0.5:
            s, e = None, None
        else:
            s, e = int(rng.integers(-2, 40)), int(rng.integers(-2, 40))
        assert V.sample_positions(n, fps, framerate, max_frames, s, e) == _reference_positions(
            n, fps, framerate, max_frames, s, e
        ), (n, fps, framerate, max_frames, s, e)


def test_sample_positions_rejects_bad_arguments():
    with pytest.raises(ValueError):
        V.sample_positions(10, 25.0, 1, 0)
    with pytest.raises(ValueError):
        V.sample_positions(10, 25.0, 0, 4)
    with pytest.raises(ValueError):
        V.sample_positions(10, 0.0, 1, 4)


# --------------------------------------------------------------------------------------------------
# probe / load_frames on a real mp4
# --------------------------------------------------------------------------------------------------


def test_import_is_light():
    code = (
        "import sys, gare.video, gare.video_loader; "
        "bad = [m for m in ('decord', 'av', 'torchvision', 'gare_train.fit', 'fastapi') if m in sys.modules]; "
        "assert not bad, bad"
    )
    import subprocess

    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}
    )


def test_probe_video(good_video):
    info = V.probe_video(good_video)
    assert (info.num_frames, info.width, info.height) == (N_FRAMES, W, H)
    assert info.fps == pytest.approx(FPS)
    assert info.duration == pytest.approx(N_FRAMES / FPS)


def _manual(path, positions, size):
    """Independent decode + torchvision CLIP transform of the given positions."""
    import decord
    from PIL import Image
    from torchvision import transforms as T

    tf = T.Compose(
        [
            T.Resize(size, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(size),
            lambda im: im.convert("RGB"),
            T.ToTensor(),
            T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ]
    )
    vr = decord.VideoReader(str(path))
    return torch.stack([tf(Image.fromarray(a)) for a in vr.get_batch(positions).asnumpy()])


@pytest.mark.parametrize(
    "max_frames, framerate, start, end",
    [(12, 1.0, None, None), (3, 2.0, None, None), (8, 3.0, 1.0, 2.5), (6, 1.0, 3, 3)],
)
def test_load_frames_matches_manual_decode(good_video, max_frames, framerate, start, end):
    size = 32
    frames, mask = V.load_frames(
        good_video, max_frames=max_frames, framerate=framerate, image_size=size, start=start, end=end
    )
    expected_pos = V.sample_positions(N_FRAMES, FPS, framerate, max_frames, start, end)
    n = len(expected_pos)
    assert 0 < n <= max_frames
    assert frames.shape == (max_frames, 3, size, size) and frames.dtype == torch.float32
    assert mask.shape == (max_frames,) and mask.dtype == torch.int64
    assert mask.tolist() == [1] * n + [0] * (max_frames - n)
    assert torch.count_nonzero(frames[n:]) == 0
    torch.testing.assert_close(frames[:n], _manual(good_video, expected_pos, size), atol=1e-6, rtol=0)

    # The decoded frames are the right ones: undo the normalisation, compare the flat brightness.
    mean = torch.tensor(V.OPENAI_MEAN).view(3, 1, 1)
    std = torch.tensor(V.OPENAI_STD).view(3, 1, 1)
    pixels = (frames[:n] * std + mean) * 255
    for img, pos in zip(pixels, expected_pos, strict=True):
        background = img[:, -6:, :].mean()  # bottom rows: no red block there
        assert abs(float(background) - _level(pos)) < 4, (pos, float(background))


def test_load_frames_window_positions(good_video):
    # 10 fps, framerate 1, window [1.5 s, 3.5 s] -> frames 15, 25, 35
    frames, mask = V.load_frames(good_video, max_frames=5, framerate=1, image_size=16, start=1.5, end=3.5)
    assert mask.tolist() == [1, 1, 1, 0, 0]
    manual = _manual(good_video, [15, 25, 35], 16)
    torch.testing.assert_close(frames[:3], manual, atol=1e-6, rtol=0)


def test_load_frames_errors(good_video, tmp_path, monkeypatch):
    with pytest.raises(V.VideoDecodeError) as ei:
        V.load_frames(good_video, max_frames=4, framerate=1, image_size=16, start=100, end=200)
    assert ei.value.reason.startswith("no frames in range")

    missing = tmp_path / "missing.mp4"
    with pytest.raises(V.VideoDecodeError) as ei:
        V.load_frames(missing, max_frames=4, framerate=1, image_size=16)
    assert ei.value.reason == "file not found" and ei.value.path == str(missing)
    assert "file not found" in str(ei.value) and str(missing) in str(ei.value)

    with pytest.raises(V.VideoDecodeError) as ei:
        V.load_frames(tmp_path, max_frames=4, framerate=1, image_size=16)
    assert ei.value.reason == "not a regular file"

    monkeypatch.setattr(V, "MAX_FRAME_PIXELS", W * H - 1)
    with pytest.raises(V.VideoDecodeError) as ei:
        V.load_frames(good_video, max_frames=4, framerate=1, image_size=16)
    assert ei.value.reason.startswith("frame too large") and f"{W}x{H}" in ei.value.reason
    with pytest.raises(V.VideoDecodeError):
        V.probe_video(good_video)


def test_decode_failure_after_open_is_a_video_decode_error(tmp_path):
    # decord 0.6 opens 48-pixel-wide videos but fails to copy their frames out (see synth.DECORD_UNREADABLE_WIDTHS)
    path = write_video(tmp_path / "w48.mp4", np.full((4, 32, 48, 3), 90, np.uint8), 8)
    try:
        frames, mask = V.load_frames(path, max_frames=2, framerate=8, image_size=16)
    except V.VideoDecodeError as e:
        assert e.reason.startswith("decode failed"), e.reason
    else:  # a fixed decord: then it must simply work
        assert frames.shape == (2, 3, 16, 16) and mask.tolist() == [1, 1]


def test_video_decode_error_pickles():
    import pickle

    e = pickle.loads(pickle.dumps(V.VideoDecodeError("/x.mp4", "empty file")))
    assert (e.path, e.reason) == ("/x.mp4", "empty file") and str(e) == "empty file: /x.mp4"


def test_video_extensions():
    assert ".mp4" in V.VIDEO_EXTENSIONS and ".webm" in V.VIDEO_EXTENSIONS and ".txt" not in V.VIDEO_EXTENSIONS
    assert all(e.startswith(".") and e == e.lower() for e in V.VIDEO_EXTENSIONS)
    assert V.is_video_file("a/B.MKV") and not V.is_video_file("a/b.json")


# --------------------------------------------------------------------------------------------------
# bad files
# --------------------------------------------------------------------------------------------------

EXPECTED_REASON = {
    "empty": "empty file",
    "truncated": ("cannot open", "decode failed"),
    "random": "cannot open",
    "no_moov": "cannot open",
    "wrong_container": ("not a video container", "cannot open"),
    "text": "cannot open",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED_REASON))
def test_bad_file_raises_video_decode_error(bad_videos, kind):
    path = bad_videos[kind]
    assert path.exists()
    with pytest.raises(V.VideoDecodeError) as ei:
        V.load_frames(path, max_frames=8, framerate=2, image_size=16)
    err = ei.value
    assert err.path == str(path)
    assert err.reason.startswith(EXPECTED_REASON[kind]), err.reason
    assert err.reason in str(err) and str(path) in str(err)


def test_bad_files_are_really_bad(bad_videos):
    assert bad_videos["empty"].stat().st_size == 0
    assert bad_videos["wrong_container"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tests.badfiles import mp4_atoms

    kinds = [t for t, _, _ in mp4_atoms(bad_videos["no_moov"].read_bytes())]
    assert b"moov" not in kinds and b"mdat" in kinds and kinds[0] == b"ftyp"
    assert b"moov" in [t for t, _, _ in mp4_atoms(bad_videos["truncated"].read_bytes())]


# --------------------------------------------------------------------------------------------------
# datasets and batches
# --------------------------------------------------------------------------------------------------


def test_clip_dataset_never_raises(good_video, bad_videos, monkeypatch):
    ds = VL.ClipDataset(
        [("g", good_video, None, None), ("e", bad_videos["empty"], None, None), ("r", bad_videos["random"])],
        max_frames=4,
        framerate=1,
        image_size=16,
    )
    ok, empty, rnd = ds[0], ds[1], ds[2]
    assert ok.error is None and ok.frames.shape == (4, 3, 16, 16) and ok.key == "g"
    assert empty.frames is None and empty.error == "empty file"
    assert rnd.error.startswith("cannot open")

    import decord

    def boom(*a, **k):
        raise decord._ffi.base.DECORDError("synthetic decord failure")

    monkeypatch.setattr(VL, "load_frames", boom)  # the binding ClipDataset calls
    clip = ds[0]
    assert clip.frames is None and "DECORDError" in clip.error

    batch = VL.collate_clips([ok, empty, rnd])
    assert (
        batch["keys"] == ["g"]
        and batch["frames"].shape == (1, 4, 3, 16, 16)
        and batch["mask"].shape == (1, 4)
    )
    assert [k for k, _ in batch["failed"]] == ["e", "r"]
    none = VL.collate_clips([empty])
    assert none["frames"] is None and none["mask"] is None and none["keys"] == []


def _run_all(items, **kw):
    kw = {"max_frames": 4, "framerate": 2, "image_size": 16, **kw}
    return list(VL.iter_decoded(items, **kw))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iter_decoded_mixes_good_and_bad(good_video, bad_videos, tmp_path, num_workers):
    items = [
        ("g0", good_video, None, None),
        *[(f"bad-{k}", p, None, None) for k, p in sorted(bad_videos.items())],
        ("g1", good_video, 1.0, 2.0),
        ("missing", tmp_path / "nope.mp4", None, None),
        ("g2", str(good_video), 0, 4),
    ]
    with deadline(60):
        batches = _run_all(items, batch_size=3, num_workers=num_workers, timeout=30)
    keys = [k for b in batches for k in b["keys"]]
    failed = dict(f for b in batches for f in b["failed"])
    assert keys == ["g0", "g1", "g2"]
    assert set(failed) == {f"bad-{k}" for k in bad_videos} | {"missing"}
    assert all(isinstance(r, str) and r for r in failed.values())
    assert failed["missing"] == "file not found" and failed["bad-empty"] == "empty file"
    for b in batches:
        if b["frames"] is not None:
            assert b["frames"].shape[0] == len(b["keys"]) == b["mask"].shape[0]
    by_key = {}
    for b in batches:
        for i, k in enumerate(b["keys"]):
            by_key[k] = (b["frames"][i], b["mask"][i])
    ref_f, ref_m = V.load_frames(good_video, max_frames=4, framerate=2, image_size=16, start=1.0, end=2.0)
    torch.testing.assert_close(by_key["g1"][0], ref_f, atol=0, rtol=0)
    assert torch.equal(by_key["g1"][1], ref_m)


def test_iter_decoded_survives_worker_crash_and_hang(good_video, monkeypatch):
    real = V.load_frames

    def flaky(path, **kw):  # runs inside forked workers, which inherit this patch
        name = Path(path).name
        if name == "crash.mp4":
            os.kill(os.getpid(), signal.SIGKILL)
        if name == "hang.mp4":
            time.sleep(600)
        return real(good_video, **kw)

    monkeypatch.setattr(VL, "load_frames", flaky)  # the binding ClipDataset calls
    items = [(f"k{i}", f"/nowhere/ok{i}.mp4", None, None) for i in range(6)]
    items.insert(2, ("crash", "/nowhere/crash.mp4", None, None))
    items.insert(5, ("hang", "/nowhere/hang.mp4", None, None))
    # a timeout that a forked worker's batch of two tiny clips stays well under on a loaded machine (3 s timed
    # out the good clips too); the hung decode sleeps far longer and costs two timeouts (its batch, then itself
    # alone); the deadline is the hang guard
    with deadline(300):
        batches = _run_all(items, batch_size=2, num_workers=2, timeout=8)
    keys = [k for b in batches for k in b["keys"]]
    failed = dict(f for b in batches for f in b["failed"])
    assert keys == [f"k{i}" for i in range(6)]
    assert set(failed) == {"crash", "hang"}
    assert "crashed" in failed["crash"] and "signal 9" in failed["crash"]
    assert "timed out" in failed["hang"]
    assert multiprocessing.active_children() == []  # every decode worker was reaped (crashed, hung or done)


def test_iter_decoded_early_break_and_empty(good_video):
    with deadline(60):
        assert list(VL.iter_decoded([], max_frames=2, framerate=1, image_size=16)) == []
        it = VL.iter_decoded(
            [(i, good_video, None, None) for i in range(8)],
            max_frames=2,
            framerate=1,
            image_size=16,
            batch_size=2,
        )
        first = next(it)
        it.close()
    assert first["keys"] == [0, 1]
    assert multiprocessing.active_children() == []  # closing the iterator ends its workers


@pytest.mark.parametrize("size", [32, 80, 16])  # downscale, upscale (bicubic both ways) and the crop
def test_uint8_frames_normalise_to_the_float_frames_bit_for_bit(good_video, size):
    """The build's decode workers send uint8 pixels (as_uint8) and the encoder's side normalises them:
    the result is torch.equal to load_frames' float32 frames, padded rows included (max_frames 60 > 47
    frames at framerate 10 leaves zero rows)."""
    for max_frames, framerate in [(12, 1.0), (60, 10.0)]:
        ref, ref_m = V.load_frames(good_video, max_frames=max_frames, framerate=framerate, image_size=size)
        u8, m = V.load_frames(good_video, max_frames=max_frames, framerate=framerate, image_size=size, as_uint8=True)
        assert u8.dtype == torch.uint8 and u8.shape == ref.shape and torch.equal(m, ref_m)
        n = int(m.sum())
        assert torch.count_nonzero(u8[n:]) == 0 and u8[:n].float().std() > 10  # real pixels, zero padding
        got = V.normalize_frames(u8, m)
        assert got.dtype == torch.float32 and torch.equal(got, ref), float((got - ref).abs().max())
        if max_frames == 60:
            assert n < max_frames and torch.equal(got[n:], torch.zeros_like(got[n:]))
        # batched (b, f, 3, S, S) with its (b, f) mask, as encode_batch calls it
        two = V.normalize_frames(torch.stack([u8, u8]), torch.stack([m, m]))
        assert torch.equal(two, torch.stack([ref, ref]))


def test_normalize_frames_cpu_ops_equal_the_table_for_every_value():
    """The CPU path (ToTensor + Normalize's ops on the batch) equals the gather from the table of those ops' results
    (the path other devices take) bit for bit, for each of the 256 values in each channel."""
    values = torch.arange(256, dtype=torch.uint8).view(16, 16)
    frames = torch.stack([values, values, values])[None]  # (f=1, 3, 16, 16): every value in every channel
    got = V.normalize_frames(frames, torch.ones(1))
    want = V._normalise_by_table(frames)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want), float((got - want).abs().max())
    assert not torch.equal(got[0, 0], got[0, 1])  # the same pixels, each channel's own mean and std


def test_normalize_frames_refuses_float():
    with pytest.raises(ValueError, match="uint8 frames, got torch.float32"):
        V.normalize_frames(torch.zeros(2, 3, 4, 4), torch.ones(2))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iter_decoded_uint8_batches(good_video, bad_videos, num_workers):
    items = [("g0", good_video, None, None), ("bad", bad_videos["empty"], None, None), ("g1", good_video, 1.0, 2.0)]
    with deadline(60):
        ref = _run_all(items, batch_size=2, num_workers=num_workers, timeout=30)
        u8 = _run_all(items, batch_size=2, num_workers=num_workers, timeout=30, as_uint8=True)
    assert [b["keys"] for b in u8] == [b["keys"] for b in ref] == [["g0"], ["g1"]]
    assert [b["failed"] for b in u8] == [b["failed"] for b in ref]
    for a, b in zip(u8, ref, strict=True):
        assert a["frames"].dtype == torch.uint8 and a["frames"].nbytes * 4 == b["frames"].nbytes
        assert torch.equal(V.normalize_frames(a["frames"], a["mask"]), b["frames"])
