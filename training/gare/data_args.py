"""The data argument group shared by `gare-train fit/evaluate` and `gare-index compare`, and the data spec it
gives (what ``gare_train.data`` reads). Light: argparse only, so a CLI can build its parser without importing
the datasets."""

from __future__ import annotations

import argparse
from typing import Any


def add_data_args(p: argparse.ArgumentParser, title: str = "data (one of)", description: str | None = None
                  ) -> argparse._ArgumentGroup:
    """--synth | --msrvtt-anno (+ --videos, --data-json) | --train-manifest/--test-manifest, as one group."""
    g = p.add_argument_group(title, description)
    g.add_argument("--synth", help="a corpus folder written by `gare-train synth`")
    g.add_argument("--msrvtt-anno", help="MSR-VTT annotation folder: MSRVTT_train.9k.csv, MSRVTT_JSFUSION_test.csv "
                                         "(and MSRVTT_data.json); with --videos")
    g.add_argument("--videos", help="MSR-VTT videos folder (<video_id>.mp4)")
    g.add_argument("--data-json", help="MSRVTT_data.json if not in --msrvtt-anno")
    g.add_argument("--train-manifest", help="your training captions: CSV (video,caption[,start,end]) or JSONL")
    g.add_argument("--test-manifest", help="your test captions: CSV (video,caption[,start,end]) or JSONL")
    return g


def data_spec(args: argparse.Namespace) -> dict[str, Any] | None:
    """The data spec of parsed `add_data_args` arguments ({"kind": "synth" | "msrvtt" | "manifest", ...}); None
    when no data was given (the checkpoint's own data is used then)."""
    if args.synth:
        return {"kind": "synth", "root": args.synth}
    if args.msrvtt_anno:
        return {"kind": "msrvtt", "anno_dir": args.msrvtt_anno, "videos_dir": args.videos, "data_json": args.data_json}
    if args.train_manifest or args.test_manifest:
        return {"kind": "manifest", "train": args.train_manifest, "test": args.test_manifest}
    return None
