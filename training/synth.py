"""A deterministic, compositional synthetic video corpus of real H.264 mp4 files.

Each video shows one or two *events* in time order on a coloured background. An event is a group of
one to three identical shapes (circle, square, triangle, diamond, cross) of one colour that move in one
way (left to right, right to left, up, down, bounce, or stay still) at one speed (slow or fast). With
two events the first one fills the first half of the clip and the second one the second half, so a
caption such as "a red circle rises, then two blue squares slide to the left" is only matched by a
model that sees order in time.

Knobs that make retrieval hard on purpose:

* ``hard_negative_rate``: videos that copy another video's scene with exactly one attribute changed
  (``attributes["changed"]`` names it: ``"background"``, ``"event0.color"``, ... or ``"order"`` when
  the two events are swapped);
* ``near_duplicate_rate``: videos with the same scene as another one and a slightly different rendering
  (position / colour / noise jitter): false negatives for the source video's captions.

Every video has mild per-video jitter (positions, sizes, colours) and per-pixel noise. Everything is a
function of ``SynthConfig`` (seed included): the same config gives identical captions, attributes and
frame pixels (libx264 runs single-threaded and without mbtree, which makes the files reproducible too).

Outputs of :func:`generate_corpus` (``out_dir``):

* ``videos/<video_id>.mp4``
* ``captions.jsonl`` (all videos), ``captions_train.jsonl``, ``captions_test.jsonl``: one
  ``{"video": "videos/<id>.mp4", "captions": [...], "attributes": {...}}`` per line, video paths
  relative to the manifest;
* MSR-VTT-style ``MSRVTT_data.json``, ``train.csv`` (``video_id``) and ``test.csv``
  (``key,vid_key,video_id,sentence``, one caption per test video, like ``MSRVTT_JSFUSION_test.csv``);
* ``corpus.json``: the config plus every video's split, captions, attributes and rendering parameters.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_write

CORPUS_VERSION = 1

BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (10, 10, 10),
    "white": (245, 245, 245),
    "gray": (128, 128, 128),
}
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (40, 180, 50),
    "blue": (35, 70, 230),
    "yellow": (240, 215, 30),
    "orange": (250, 135, 20),
    "purple": (140, 45, 190),
    "pink": (250, 125, 190),
    "cyan": (30, 205, 220),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")
MOTIONS: tuple[str, ...] = ("left_to_right", "right_to_left", "up", "down", "bounce", "still")
SPEEDS: tuple[str, ...] = ("slow", "fast")
COUNTS: tuple[int, ...] = (1, 2, 3)
EVENT_FIELDS: tuple[str, ...] = ("shape", "color", "count", "motion", "speed")

# decord 0.6 fails on frames of these widths ("DECORDArrayCopyFromTo: The size must exactly match");
# found by encoding every even width from 16 to 400 and decoding it back.
DECORD_UNREADABLE_WIDTHS = frozenset({16, 24, 48, 72})

# ---- caption vocabulary --------------------------------------------------------------------------

_BG_WORDS = {"black": ["black", "dark"], "white": ["white"], "gray": ["gray", "grey"]}
_COLOR_WORDS = {c: [c] for c in COLORS} | {"purple": ["purple", "violet"]}
_SHAPE_WORDS: dict[str, list[tuple[str, str]]] = {
    "circle": [("circle", "circles"), ("disc", "discs"), ("ball", "balls")],
    "square": [("square", "squares"), ("box", "boxes")],
    "triangle": [("triangle", "triangles")],
    "diamond": [("diamond", "diamonds"), ("rhombus", "rhombuses")],
    "cross": [("cross", "crosses"), ("plus sign", "plus signs")],
}
_COUNT_WORDS = {1: ["a", "one", "a single"], 2: ["two", "a pair of"], 3: ["three"]}
_MOTION_WORDS: dict[str, list[tuple[str, str]]] = {
    "left_to_right": [
        ("moves from left to right", "move from left to right"),
        ("slides to the right", "slide to the right"),
        ("travels rightward", "travel rightward"),
    ],
    "right_to_left": [
        ("moves from right to left", "move from right to left"),
        ("slides to the left", "slide to the left"),
        ("travels leftward", "travel leftward"),
    ],
    "up": [("moves up", "move up"), ("rises", "rise"), ("floats upward", "float upward")],
    "down": [("moves down", "move down"), ("falls", "fall"), ("sinks downward", "sink downward")],
    "bounce": [("bounces", "bounce"), ("bounces up and down", "bounce up and down"), ("hops", "hop")],
    "still": [
        ("stays still", "stay still"),
        ("does not move", "do not move"),
        ("sits motionless", "sit motionless"),
    ],
}
_SPEED_PRE = {"slow": ["slowly", "gently"], "fast": ["quickly", "rapidly"]}
_SPEED_POST = {"slow": ["slowly", "at a slow pace"], "fast": ["quickly", "fast", "at high speed"]}
_BG_PHRASES = [
    "on a {bg} background",
    "against a {bg} backdrop",
    "in front of a {bg} background",
    "over a {bg} screen",
]
_SEQ_TEMPLATES = [
    "{a}, then {b}",
    "first {a}, then {b}",
    "{a}, and after that {b}",
    "after {a}, {b}",
    "{a} before {b}",
    "{b} after {a}",
]


@dataclass(frozen=True)
class SynthConfig:
    n_videos: int = 200
    seed: int = 0
    width: int = 96
    height: int = 96
    fps: float = 8.0
    duration: float = 4.0  # seconds
    captions_per_video: int = 3
    two_event_rate: float = 0.5  # fraction of fresh scenes with two events in time order
    hard_negative_rate: float = 0.1
    near_duplicate_rate: float = 0.05
    test_fraction: float = 0.2
    position_jitter: float = 0.06  # fraction of the frame
    size_jitter: float = 0.1  # relative
    color_jitter: int = 18  # per channel, 0..255 scale
    pixel_noise: float = 3.0  # std of per-pixel Gaussian noise, 0..255 scale
    crf: int = 18  # libx264 quality

    def __post_init__(self) -> None:
        if self.n_videos < 1:
            raise ValueError(f"n_videos must be >= 1, got {self.n_videos}")
        if self.width < 16 or self.height < 16 or self.width % 2 or self.height % 2:
            raise ValueError(f"width/height must be even and >= 16, got {self.width}x{self.height}")
        if self.width in DECORD_UNREADABLE_WIDTHS:
            raise ValueError(f"decord 0.6 cannot decode {self.width}-pixel-wide videos; pick another width")
        if not (self.fps > 0) or not (self.duration > 0):
            raise ValueError("fps and duration must be > 0")
        if self.num_frames < 2:
            raise ValueError(f"fps * duration must give at least 2 frames, got {self.num_frames}")
        if self.captions_per_video < 1:
            raise ValueError("captions_per_video must be >= 1")
        for name in ("two_event_rate", "hard_negative_rate", "near_duplicate_rate", "test_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.hard_negative_rate + self.near_duplicate_rate > 0.9:
            raise ValueError("hard_negative_rate + near_duplicate_rate must leave at least 10% fresh videos")

    @property
    def num_frames(self) -> int:
        return int(round(self.fps * self.duration))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SynthConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown SynthConfig fields: {sorted(unknown)}")
        return cls(**d)


presets: dict[str, SynthConfig] = {
    # a few seconds to generate: CI and smoke tests
    "tiny": SynthConfig(n_videos=16, seed=0, duration=2.0, captions_per_video=2),
    "small": SynthConfig(n_videos=200, seed=0),
    # the benchmark corpus
    "bench": SynthConfig(n_videos=1000, seed=0, hard_negative_rate=0.15, near_duplicate_rate=0.05),
}


# ---- scenes ---------------------------------------------------------------------------------------


def _visible(event: dict[str, Any]) -> tuple[Any, ...]:
    """The attributes of an event that change its pixels (speed is invisible for a still event)."""
    speed = None if event["motion"] == "still" else event["speed"]
    return (event["shape"], event["color"], event["count"], event["motion"], speed)


def scene_key(scene: dict[str, Any]) -> tuple[Any, ...]:
    """Hashable identity of what a scene looks like."""
    return (scene["background"], *(_visible(e) for e in scene["events"]))


def flatten_scene(scene: dict[str, Any]) -> dict[str, Any]:
    """``{"background": .., "event0.shape": .., ...}``; used to compare scenes attribute by attribute."""
    flat: dict[str, Any] = {"background": scene["background"], "n_events": len(scene["events"])}
    for i, e in enumerate(scene["events"]):
        for f in EVENT_FIELDS:
            flat[f"event{i}.{f}"] = e[f]
    return flat


def _choice(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _random_event(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "shape": _choice(rng, SHAPES),
        "color": _choice(rng, sorted(COLORS)),
        "count": int(_choice(rng, COUNTS)),
        "motion": _choice(rng, MOTIONS),
        "speed": _choice(rng, SPEEDS),
    }


def _valid_scene(scene: dict[str, Any]) -> bool:
    ev = scene["events"]
    return len(ev) == 1 or _visible(ev[0]) != _visible(ev[1])


def _random_scene(rng: np.random.Generator, cfg: SynthConfig) -> dict[str, Any]:
    while True:
        bg = _choice(rng, sorted(BACKGROUNDS))
        n_events = 2 if rng.random() < cfg.two_event_rate else 1
        scene = {"background": bg, "events": [_random_event(rng) for _ in range(n_events)]}
        if _valid_scene(scene):
            return scene


def _mutations(scene: dict[str, Any]) -> list[str]:
    out = ["background"]
    for i, e in enumerate(scene["events"]):
        out += [f"event{i}.{f}" for f in ("shape", "color", "count", "motion")]
        if e["motion"] != "still":
            out.append(f"event{i}.speed")
    if len(scene["events"]) == 2:
        out.append("order")
    return out


def mutate_scene(scene: dict[str, Any], what: str, rng: np.random.Generator) -> dict[str, Any]:
    """A copy of ``scene`` with exactly one attribute (``what``) changed to a different value."""
    new = copy.deepcopy(scene)
    if what == "background":
        new["background"] = _choice(rng, [b for b in sorted(BACKGROUNDS) if b != scene["background"]])
    elif what == "order":
        new["events"] = new["events"][::-1]
    else:
        ev, field = what.split(".")
        e = new["events"][int(ev[len("event") :])]
        options: Sequence[Any] = {
            "shape": SHAPES,
            "color": sorted(COLORS),
            "count": COUNTS,
            "motion": MOTIONS,
            "speed": SPEEDS,
        }[field]
        e[field] = _choice(rng, [o for o in options if o != e[field]])
    return new


# ---- captions -------------------------------------------------------------------------------------


def _article(words: str) -> str:
    if words.startswith("a ") and words[2:3] in "aeiou":
        return "an " + words[2:]
    return words


def _event_phrase(e: dict[str, Any], rng: np.random.Generator, sentence_start: bool = True) -> str:
    n = e["count"]
    sing, plur = _choice(rng, _SHAPE_WORDS[e["shape"]])
    verb_s, verb_p = _choice(rng, _MOTION_WORDS[e["motion"]])
    noun, verb = (sing, verb_s) if n == 1 else (plur, verb_p)
    np_ = _article(f"{_choice(rng, _COUNT_WORDS[n])} {_choice(rng, _COLOR_WORDS[e['color']])} {noun}")
    if e["motion"] == "still":
        vp = verb
    elif rng.random() < 0.5:
        vp = f"{_choice(rng, _SPEED_PRE[e['speed']])} {verb}"
    else:
        vp = f"{verb} {_choice(rng, _SPEED_POST[e['speed']])}"
    if sentence_start and rng.random() < 0.2:
        return f"there {'is' if n == 1 else 'are'} {np_} that {vp}"
    return f"{np_} {vp}"


def make_caption(scene: dict[str, Any], rng: np.random.Generator) -> str:
    """One paraphrase describing every visible attribute of ``scene`` (order included)."""
    if len(scene["events"]) == 1:
        body = _event_phrase(scene["events"][0], rng)
    else:
        template = _choice(rng, _SEQ_TEMPLATES)
        a = _event_phrase(scene["events"][0], rng, sentence_start=template.startswith("{a}"))
        b = _event_phrase(scene["events"][1], rng, sentence_start=False)
        body = template.format(a=a, b=b)
    bg = _choice(rng, _BG_PHRASES).format(bg=_choice(rng, _BG_WORDS[scene["background"]]))
    if rng.random() < 0.3:
        return f"{bg}, {body}"
    return f"{body} {bg}"


def make_captions(scene: dict[str, Any], k: int, rng: np.random.Generator) -> list[str]:
    out: list[str] = []
    for _ in range(50 * k):
        c = make_caption(scene, rng)
        if c not in out:
            out.append(c)
            if len(out) == k:
                break
    while len(out) < k:  # tiny vocabularies: allow repeats rather than fail
        out.append(make_caption(scene, rng))
    return out


# ---- rendering ------------------------------------------------------------------------------------


def _random_render(scene: dict[str, Any], cfg: SynthConfig, rng: np.random.Generator) -> dict[str, Any]:
    """Per-video nuisance parameters (the jitter that makes the task not trivially solvable)."""
    pj, cj = cfg.position_jitter, cfg.color_jitter
    events = []
    for e in scene["events"]:
        events.append(
            {
                "offset": [float(v) for v in rng.uniform(-pj, pj, size=2)],
                "slot_jitter": [float(v) for v in rng.uniform(-pj / 2, pj / 2, size=e["count"])],
                "size": float(rng.uniform(1 - cfg.size_jitter, 1 + cfg.size_jitter)),
                "color": [int(v) for v in rng.integers(-cj, cj + 1, size=3)],
                "phase": float(rng.uniform(0, 0.25)),
            }
        )
    # Background: a brightness shift plus a small tint, so a gray background stays gray.
    shift = int(rng.integers(-cj, cj + 1))
    tint = rng.integers(-(cj // 4), cj // 4 + 1, size=3)
    return {
        "background": [int(shift + v) for v in tint],
        "events": events,
        "noise_seed": int(rng.integers(2**31 - 1)),
    }


def _near_duplicate_render(src: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    new = copy.deepcopy(src)
    for ev in new["events"]:
        ev["offset"] = [v + float(rng.uniform(-0.01, 0.01)) for v in ev["offset"]]
        ev["slot_jitter"] = [v + float(rng.uniform(-0.005, 0.005)) for v in ev["slot_jitter"]]
        ev["size"] *= float(rng.uniform(0.98, 1.02))
        ev["color"] = [int(v + rng.integers(-4, 5)) for v in ev["color"]]
    new["background"] = [int(v + rng.integers(-4, 5)) for v in new["background"]]
    new["noise_seed"] = int(rng.integers(2**31 - 1))
    return new


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    ax, ay = np.abs(dx), np.abs(dy)
    if shape == "circle":
        return dx * dx + dy * dy <= 1.0
    if shape == "square":
        return np.maximum(ax, ay) <= 0.85
    if shape == "diamond":
        return ax + ay <= 1.05
    if shape == "triangle":  # apex up
        return (dy >= -1.0) & (dy <= 0.8) & (ax <= (dy + 1.0) / 1.8)
    if shape == "cross":
        return ((ax <= 0.32) & (ay <= 1.0)) | ((ay <= 0.32) & (ax <= 1.0))
    raise ValueError(f"unknown shape {shape!r}")


def _object_centres(e: dict[str, Any], r: dict[str, Any], u: float) -> list[tuple[float, float]]:
    """Normalised (x, y) centres of the event's objects at progress ``u`` in [0, 1]."""
    k = e["count"]
    ox, oy = r["offset"]
    slots = [(j + 1) / (k + 1) + r["slot_jitter"][j] for j in range(k)]
    dist = 0.35 if e["speed"] == "slow" else 0.75
    m = e["motion"]
    if m == "left_to_right":
        return [(0.5 + ox - dist / 2 + dist * u, s) for s in slots]
    if m == "right_to_left":
        return [(0.5 + ox + dist / 2 - dist * u, s) for s in slots]
    if m == "up":
        return [(s, 0.5 + oy + dist / 2 - dist * u) for s in slots]
    if m == "down":
        return [(s, 0.5 + oy - dist / 2 + dist * u) for s in slots]
    if m == "bounce":
        cycles = 1.5 if e["speed"] == "slow" else 3.5
        y = 0.68 + oy - 0.36 * abs(math.sin(math.pi * (cycles * u + r["phase"])))
        return [(s, y) for s in slots]
    if m == "still":
        return [(s, 0.5 + oy) for s in slots]
    raise ValueError(f"unknown motion {m!r}")


def render_scene(scene: dict[str, Any], render: dict[str, Any], cfg: SynthConfig) -> np.ndarray:
    """Frames ``(T, H, W, 3)`` uint8 for a scene; a pure function of its arguments."""
    t_total, h, w = cfg.num_frames, cfg.height, cfg.width
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    xx += 0.5
    yy += 0.5
    bg = np.clip(np.array(BACKGROUNDS[scene["background"]]) + np.array(render["background"]), 0, 255)
    events = scene["events"]
    bounds = np.linspace(0, t_total, len(events) + 1).round().astype(int)
    noise_rng = np.random.default_rng(render["noise_seed"])
    side = min(h, w)
    frames = np.empty((t_total, h, w, 3), dtype=np.uint8)
    for t in range(t_total):
        i = int(np.searchsorted(bounds, t, side="right") - 1)
        e, r = events[i], render["events"][i]
        a, b = bounds[i], bounds[i + 1]
        u = (t - a) / max(b - a - 1, 1)
        canvas = np.empty((h, w, 3), dtype=np.float32)
        canvas[:] = bg
        colour = np.clip(np.array(COLORS[e["color"]]) + np.array(r["color"]), 0, 255)
        radius = {1: 0.13, 2: 0.11, 3: 0.085}[e["count"]] * side * r["size"]
        for cx, cy in _object_centres(e, r, u):
            mask = _shape_mask(e["shape"], (xx - cx * w) / radius, (yy - cy * h) / radius)
            canvas[mask] = colour
        if cfg.pixel_noise > 0:
            canvas += noise_rng.normal(0.0, cfg.pixel_noise, size=canvas.shape).astype(np.float32)
        frames[t] = np.clip(np.rint(canvas), 0, 255).astype(np.uint8)
    return frames


# ---- mp4 writing ----------------------------------------------------------------------------------


def write_video(
    path: str | os.PathLike[str],
    frames: np.ndarray,
    fps: float,
    *,
    crf: int = 18,
    preset: str = "veryfast",
    faststart: bool = True,
) -> Path:
    """Encode ``frames`` (T, H, W, 3) uint8 RGB as H.264 (yuv420p) mp4 with PyAV.

    H and W must be even (yuv420p). Encoding is single-threaded and without mbtree so that the same
    frames always give the same bytes. With
    ``faststart`` the ``moov`` atom is written before the media data.
    """
    import av

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    t, h, w, _ = frames.shape
    if t < 1:
        raise ValueError("need at least one frame")
    if h % 2 or w % 2:
        raise ValueError(f"H.264 yuv420p needs even dimensions, got {w}x{h}")
    if not (fps > 0):
        raise ValueError(f"fps must be > 0, got {fps}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rate = Fraction(fps).limit_denominator(1001)
    options = {"movflags": "+faststart"} if faststart else {}
    with av.open(str(path), mode="w", format="mp4", options=options) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.thread_count = 1
        stream.options = {
            "crf": str(int(crf)),
            "preset": preset,
            "threads": "1",
            "g": str(max(1, int(round(float(rate) * 2)))),
            # x264's macroblock-tree rate control made the output of identical input depend on what
            # was encoded before in the same process (seen with libx264 in PyAV 18); without it the
            # encoder is reproducible.
            "x264-params": "mbtree=0",
        }
        for i, arr in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(arr), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# ---- corpus ---------------------------------------------------------------------------------------


def _plan(cfg: SynthConfig) -> list[dict[str, Any]]:
    """Scenes, captions and rendering parameters for every video (no pixels yet)."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5EED]))
    n = cfg.n_videos
    n_hard = int(round(n * cfg.hard_negative_rate))
    n_dup = int(round(n * cfg.near_duplicate_rate))
    n_fresh = max(1, n - n_hard - n_dup)
    n_dup = min(n_dup, n - n_fresh)
    n_hard = n - n_fresh - n_dup

    seen: set[tuple[Any, ...]] = set()
    plans: list[dict[str, Any]] = []
    for _ in range(n_fresh):
        for _attempt in range(1000):
            scene = _random_scene(rng, cfg)
            if scene_key(scene) not in seen:
                break
        seen.add(scene_key(scene))
        plans.append({"scene": scene, "kind": "fresh", "source": None, "changed": None})

    for _ in range(n_hard):
        for _attempt in range(1000):
            src = int(rng.integers(n_fresh))
            what = _choice(rng, _mutations(plans[src]["scene"]))
            scene = mutate_scene(plans[src]["scene"], what, rng)
            if _valid_scene(scene) and scene_key(scene) not in seen:
                break
        seen.add(scene_key(scene))
        plans.append({"scene": scene, "kind": "hard_negative", "source": src, "changed": what})

    for _ in range(n_dup):
        src = int(rng.integers(n_fresh))
        plans.append(
            {
                "scene": copy.deepcopy(plans[src]["scene"]),
                "kind": "near_duplicate",
                "source": src,
                "changed": None,
            }
        )

    for p in plans:
        if p["kind"] != "near_duplicate":
            p["render"] = _random_render(p["scene"], cfg, rng)
    for p in plans:
        if p["kind"] == "near_duplicate":
            p["render"] = _near_duplicate_render(plans[p["source"]]["render"], rng)
    for p in plans:
        p["captions"] = make_captions(p["scene"], cfg.captions_per_video, rng)

    # Shuffle so that derived videos are interleaved with fresh ones, then name them.
    order = rng.permutation(len(plans))
    vid_of = {int(old): f"video{new}" for new, old in enumerate(order)}
    for old, p in enumerate(plans):
        p["video_id"] = vid_of[old]
        p["source"] = None if p["source"] is None else vid_of[p["source"]]
    plans = [plans[int(i)] for i in order]

    # Split by groups (a fresh video with its hard negatives and near duplicates) so that the test
    # split contains the hard cases together with what they are confusable with.
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(plans):
        groups.setdefault(p["source"] or p["video_id"], []).append(i)
    n_test = 0 if n < 2 else min(n - 1, max(1, int(round(n * cfg.test_fraction))))
    test: set[int] = set()
    for g in rng.permutation(sorted(groups)):
        if len(test) >= n_test:
            break
        test.update(groups[str(g)])
    if n >= 2 and len(test) == n:  # keep at least one training video
        test.discard(max(test))
    for i, p in enumerate(plans):
        p["split"] = "test" if i in test else "train"
    return plans


def _attributes(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "video_id": p["video_id"],
        "background": p["scene"]["background"],
        "events": copy.deepcopy(p["scene"]["events"]),
        "kind": p["kind"],
        "source": p["source"],
        "changed": p["changed"],
        "split": p["split"],
    }


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=1, ensure_ascii=False), encoding="utf-8"))


def generate_corpus(
    out_dir: str | os.PathLike[str], cfg: SynthConfig | None = None, progress: bool = True
) -> dict[str, Any]:
    """Write the corpus described by ``cfg`` under ``out_dir`` (see module docstring).

    Returns a summary: ``out_dir``, ``n_videos``, ``train``/``test`` (video ids), and the paths of
    ``videos_dir``, ``manifest`` (captions.jsonl), ``manifest_train``, ``manifest_test``,
    ``msrvtt_data``, ``train_csv``, ``test_csv`` and ``corpus_json``.
    """
    from tqdm import tqdm

    cfg = cfg or SynthConfig()
    out = Path(out_dir)
    videos_dir = out / "videos"
    videos_dir.mkdir(parents=True, exist_ok=True)
    plans = _plan(cfg)
    # Remove videos of an earlier, larger corpus written to the same place (our naming scheme only).
    current = {f"{p['video_id']}.mp4" for p in plans}
    for stale in videos_dir.glob("video*.mp4"):
        if stale.name not in current and stale.name[len("video") : -len(".mp4")].isdigit():
            stale.unlink()

    for p in tqdm(plans, desc="synth videos", unit="video", disable=not progress):
        frames = render_scene(p["scene"], p["render"], cfg)
        final = videos_dir / f"{p['video_id']}.mp4"
        tmp = videos_dir / f".{p['video_id']}.tmp.mp4"
        write_video(tmp, frames, cfg.fps, crf=cfg.crf)
        os.replace(tmp, final)

    rows = [
        {
            "video": f"videos/{p['video_id']}.mp4",
            "captions": list(p["captions"]),
            "attributes": _attributes(p),
        }
        for p in plans
    ]
    _write_jsonl(out / "captions.jsonl", rows)
    _write_jsonl(
        out / "captions_train.jsonl", [r for r, p in zip(rows, plans, strict=True) if p["split"] == "train"]
    )
    _write_jsonl(
        out / "captions_test.jsonl", [r for r, p in zip(rows, plans, strict=True) if p["split"] == "test"]
    )

    # MSR-VTT layout
    ids_sorted = sorted(plans, key=lambda p: int(p["video_id"][len("video") :]))
    msr_videos = [
        {
            "category": 0,
            "url": "",
            "video_id": p["video_id"],
            "start time": 0.0,
            "end time": cfg.num_frames / cfg.fps,
            "split": "train" if p["split"] == "train" else "test",
            "id": int(p["video_id"][len("video") :]),
        }
        for p in ids_sorted
    ]
    sentences = []
    for p in ids_sorted:
        for c in p["captions"]:
            sentences.append({"caption": c, "video_id": p["video_id"], "sen_id": len(sentences)})
    _write_json(
        out / "MSRVTT_data.json", {"info": {"synthetic": True}, "videos": msr_videos, "sentences": sentences}
    )
    train_ids = [p["video_id"] for p in ids_sorted if p["split"] == "train"]
    test_plans = [p for p in ids_sorted if p["split"] == "test"]
    with open(out / "train.csv", "w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(["video_id"])
        wr.writerows([[v] for v in train_ids])
    with open(out / "test.csv", "w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(["key", "vid_key", "video_id", "sentence"])
        for i, p in enumerate(test_plans):
            num = p["video_id"][len("video") :]
            wr.writerow([f"ret{i}", f"msr{num}", p["video_id"], p["captions"][0]])

    corpus = {
        "version": CORPUS_VERSION,
        "config": cfg.to_dict(),
        "train": train_ids,
        "test": [p["video_id"] for p in test_plans],
        "videos": [
            {
                "video_id": p["video_id"],
                "path": f"videos/{p['video_id']}.mp4",
                "split": p["split"],
                "captions": list(p["captions"]),
                "attributes": _attributes(p),
                "render": p["render"],
            }
            for p in ids_sorted
        ],
    }
    _write_json(out / "corpus.json", corpus)
    return {
        "out_dir": str(out),
        "n_videos": len(plans),
        "train": train_ids,
        "test": corpus["test"],
        "videos_dir": str(videos_dir),
        "manifest": str(out / "captions.jsonl"),
        "manifest_train": str(out / "captions_train.jsonl"),
        "manifest_test": str(out / "captions_test.jsonl"),
        "msrvtt_data": str(out / "MSRVTT_data.json"),
        "train_csv": str(out / "train.csv"),
        "test_csv": str(out / "test.csv"),
        "corpus_json": str(out / "corpus.json"),
    }
