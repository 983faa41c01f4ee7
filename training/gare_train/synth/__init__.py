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
The package, one module per concept: ``config`` (vocabulary, :class:`SynthConfig`, presets), ``scenes``,
``captions``, ``render`` (frames), ``mp4`` (:func:`write_video`) and ``corpus`` (:func:`generate_corpus`).
It is CLI-side (``gare-train synth``, tests, the demo, benchmarks): nothing in the light training core
imports it.
"""

from __future__ import annotations

from gare_train.synth.captions import make_caption, make_captions
from gare_train.synth.corpus import generate_corpus
from gare_train.synth.corpus_config import (
    BACKGROUNDS,
    COLORS,
    CORPUS_VERSION,
    COUNTS,
    DECORD_UNREADABLE_WIDTHS,
    EVENT_FIELDS,
    MOTIONS,
    SHAPES,
    SPEEDS,
    SynthConfig,
    presets,
)
from gare_train.synth.mp4 import write_video
from gare_train.synth.render import render_scene
from gare_train.synth.scenes import flatten_scene, mutate_scene, scene_key

__all__ = [
    "BACKGROUNDS", "COLORS", "CORPUS_VERSION", "COUNTS", "DECORD_UNREADABLE_WIDTHS", "EVENT_FIELDS", "MOTIONS",
    "SHAPES", "SPEEDS", "SynthConfig", "flatten_scene", "generate_corpus", "make_caption", "make_captions",
    "mutate_scene", "presets", "render_scene", "scene_key", "write_video",
]
