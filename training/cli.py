"""`gare-train`: synth | fit | eval | import-official | info. Heavy modules are imported per subcommand."""

from __future__ import annotations

import argparse
import json
import logging
import sys

log = logging.getLogger(__name__)


def _cmd_import_official(args: argparse.Namespace) -> int:
    from .official import import_official

    report = import_official(
        args.src, args.out, max_frames=args.max_frames, max_words=args.max_words, temp=args.temp,
        video_framerate=args.video_framerate, backbone=args.backbone,
    )
    print(f"backbone {report.config.backbone}: {report.summary()}")
    print(f"wrote {args.out}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .checkpoint import file_sha256, read_checkpoint

    ckpt = read_checkpoint(args.checkpoint)
    out = {
        "path": args.checkpoint,
        "sha256": file_sha256(args.checkpoint),
        "model_config": ckpt.config.to_dict(),
        "parameters": sum(v.numel() for v in ckpt.state_dict.values()),
        "queues": {k: list(v.shape) for k, v in ckpt.queues.items()},
        "train_args": ckpt.train_args,
        "info": {k: v for k, v in ckpt.info.items() if k != "dropped"},
    }
    print(json.dumps(out, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gare-train", description="Train, evaluate and convert GARE models.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    imp = sub.add_parser("import-official", help="convert a checkpoint saved by the authors' training code")
    imp.add_argument("src", help="their pytorch_model.bin.N (a state dict; loaded with weights_only=True)")
    imp.add_argument("out", help="our checkpoint (.safetensors)")
    imp.add_argument("--max-frames", type=int, default=12)
    imp.add_argument("--max-words", type=int, default=32)
    imp.add_argument("--temp", type=float, default=3.0)
    imp.add_argument("--video-framerate", type=float, default=1.0)
    imp.add_argument("--backbone", default=None, help="open_clip name; inferred from the tensor sizes by default")
    imp.set_defaults(fn=_cmd_import_official)

    info = sub.add_parser("info", help="print a checkpoint's header")
    info.add_argument("checkpoint")
    info.set_defaults(fn=_cmd_info)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


# Later subcommands register themselves here (synth, fit, eval) without making this module heavy.
_EXTRA_COMMANDS: list = []


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"gare-train {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
