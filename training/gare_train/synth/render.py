"""Rendering a scene to frames (T, H, W, 3) uint8: per-video jitter of positions, sizes and colours, per-pixel
noise; near-duplicate renderings of a scene."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np

from gare_train.synth.corpus_config import BACKGROUNDS, COLORS, SynthConfig


def random_render(scene: dict[str, Any], cfg: SynthConfig, rng: np.random.Generator) -> dict[str, Any]:
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


def near_duplicate_render(src: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
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
