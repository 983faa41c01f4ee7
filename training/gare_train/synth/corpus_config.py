"""The synthetic corpus's vocabulary of scenes (backgrounds, colours, shapes, motions, speeds) and its
configuration (:class:`SynthConfig`, with named presets)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gare.strict_fields import strict_from_dict

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
        return strict_from_dict(cls, d)


presets: dict[str, SynthConfig] = {
    # a few seconds to generate: CI and smoke tests
    "tiny": SynthConfig(n_videos=16, seed=0, duration=2.0, captions_per_video=2),
    "small": SynthConfig(n_videos=200, seed=0),
    # the benchmark corpus
    "bench": SynthConfig(n_videos=1000, seed=0, hard_negative_rate=0.15, near_duplicate_rate=0.05),
}
