"""Captions of a scene: a vocabulary of synonyms per attribute and sentence templates, sampled per caption."""

from __future__ import annotations

from typing import Any

import numpy as np

from gare_train.synth.corpus_config import COLORS
from gare_train.synth.scenes import rng_choice

# ---- caption vocabulary --------------------------------------------------------------------------

BG_WORDS = {"black": ["black", "dark"], "white": ["white"], "gray": ["gray", "grey"]}
COLOR_WORDS = {c: [c] for c in COLORS} | {"purple": ["purple", "violet"]}
SHAPE_WORDS: dict[str, list[tuple[str, str]]] = {
    "circle": [("circle", "circles"), ("disc", "discs"), ("ball", "balls")],
    "square": [("square", "squares"), ("box", "boxes")],
    "triangle": [("triangle", "triangles")],
    "diamond": [("diamond", "diamonds"), ("rhombus", "rhombuses")],
    "cross": [("cross", "crosses"), ("plus sign", "plus signs")],
}
COUNT_WORDS = {1: ["a", "one", "a single"], 2: ["two", "a pair of"], 3: ["three"]}
MOTION_WORDS: dict[str, list[tuple[str, str]]] = {
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
SPEED_PRE = {"slow": ["slowly", "gently"], "fast": ["quickly", "rapidly"]}
SPEED_POST = {"slow": ["slowly", "at a slow pace"], "fast": ["quickly", "fast", "at high speed"]}
BG_PHRASES = [
    "on a {bg} background",
    "against a {bg} backdrop",
    "in front of a {bg} background",
    "over a {bg} screen",
]
SEQ_TEMPLATES = [
    "{a}, then {b}",
    "first {a}, then {b}",
    "{a}, and after that {b}",
    "after {a}, {b}",
    "{a} before {b}",
    "{b} after {a}",
]





def _article(words: str) -> str:
    if words.startswith("a ") and words[2:3] in "aeiou":
        return "an " + words[2:]
    return words


def _event_phrase(e: dict[str, Any], rng: np.random.Generator, sentence_start: bool = True) -> str:
    n = e["count"]
    sing, plur = rng_choice(rng, SHAPE_WORDS[e["shape"]])
    verb_s, verb_p = rng_choice(rng, MOTION_WORDS[e["motion"]])
    noun, verb = (sing, verb_s) if n == 1 else (plur, verb_p)
    np_ = _article(f"{rng_choice(rng, COUNT_WORDS[n])} {rng_choice(rng, COLOR_WORDS[e['color']])} {noun}")
    if e["motion"] == "still":
        vp = verb
    elif rng.random() < 0.5:
        vp = f"{rng_choice(rng, SPEED_PRE[e['speed']])} {verb}"
    else:
        vp = f"{verb} {rng_choice(rng, SPEED_POST[e['speed']])}"
    if sentence_start and rng.random() < 0.2:
        return f"there {'is' if n == 1 else 'are'} {np_} that {vp}"
    return f"{np_} {vp}"


def make_caption(scene: dict[str, Any], rng: np.random.Generator) -> str:
    """One paraphrase describing every visible attribute of ``scene`` (order included)."""
    if len(scene["events"]) == 1:
        body = _event_phrase(scene["events"][0], rng)
    else:
        template = rng_choice(rng, SEQ_TEMPLATES)
        a = _event_phrase(scene["events"][0], rng, sentence_start=template.startswith("{a}"))
        b = _event_phrase(scene["events"][1], rng, sentence_start=False)
        body = template.format(a=a, b=b)
    bg = rng_choice(rng, BG_PHRASES).format(bg=rng_choice(rng, BG_WORDS[scene["background"]]))
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
