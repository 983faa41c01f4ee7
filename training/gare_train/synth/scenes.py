"""Scenes: one or two events (a group of identical shapes of one colour moving one way at one speed) on a
background; random scenes and single-attribute mutations (the corpus's hard negatives)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from gare_train.synth.corpus_config import (
    BACKGROUNDS,
    COLORS,
    COUNTS,
    EVENT_FIELDS,
    MOTIONS,
    SHAPES,
    SPEEDS,
    SynthConfig,
)


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


def rng_choice(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _random_event(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "shape": rng_choice(rng, SHAPES),
        "color": rng_choice(rng, sorted(COLORS)),
        "count": int(rng_choice(rng, COUNTS)),
        "motion": rng_choice(rng, MOTIONS),
        "speed": rng_choice(rng, SPEEDS),
    }


def valid_scene(scene: dict[str, Any]) -> bool:
    ev = scene["events"]
    return len(ev) == 1 or _visible(ev[0]) != _visible(ev[1])


def random_scene(rng: np.random.Generator, cfg: SynthConfig) -> dict[str, Any]:
    while True:
        bg = rng_choice(rng, sorted(BACKGROUNDS))
        n_events = 2 if rng.random() < cfg.two_event_rate else 1
        scene = {"background": bg, "events": [_random_event(rng) for _ in range(n_events)]}
        if valid_scene(scene):
            return scene


def scene_mutations(scene: dict[str, Any]) -> list[str]:
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
        new["background"] = rng_choice(rng, [b for b in sorted(BACKGROUNDS) if b != scene["background"]])
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
        e[field] = rng_choice(rng, [o for o in options if o != e[field]])
    return new
