"""`gare-train`: synth | fit | eval | import-official | info. Heavy modules are imported per subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from gare.annotations import carve_validation, load_dataset
from gare.checkpoint import file_sha256, load_model, read_checkpoint
from gare.cli_logging import setup_cli_logging
from gare.config import get_model_config
from gare.data_args import add_data_args, data_spec
from gare.encoded_set import encode_set
from gare.model import resolve_device
from gare_train.authors_checkpoint import import_official
from gare_train.evaluate import evaluate_encoded, write_report
from gare_train.fit import TrainConfig, Trainer
from gare_train.synth import SynthConfig, generate_corpus, presets

log = logging.getLogger(__name__)


def _cmd_import_official(args: argparse.Namespace) -> int:
    report = import_official(
        args.src, args.out, max_frames=args.max_frames, max_words=args.max_words, temp=args.temp,
        video_framerate=args.video_framerate, backbone=args.backbone,
    )
    print(f"backbone {report.config.backbone}: {report.summary()}")
    print(f"wrote {args.out}")
    return 0


def _require_file(path: str | None, what: str, fix: str) -> None:
    """Fail before any checkpoint or data is read when a named input file is missing."""
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"{what} {path!r} does not exist or is not a file; {fix}")


def _cmd_info(args: argparse.Namespace) -> int:
    _require_file(args.checkpoint, "checkpoint", "give a .safetensors written by `gare-train fit` or `import-official`")
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
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    cfg = out["model_config"]
    print(f"checkpoint  {out['path']}")
    print(f"sha256      {out['sha256']}")
    print(f"model       {cfg.get('name', '?')} (backbone {cfg.get('backbone', '?')}, embed_dim {cfg.get('embed_dim', '?')}, "
          f"{cfg.get('max_frames', '?')} frames, {cfg.get('max_words', '?')} words)")
    print(f"parameters  {out['parameters']:,}")
    print(f"queues      {', '.join(f'{k} {v}' for k, v in out['queues'].items()) or 'none'}")
    for k, v in out["info"].items():
        print(f"{k:<11} {v}")
    print("(--json prints everything, including the training arguments)")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    base = presets[args.preset] if args.preset else SynthConfig()
    over = {k: v for k, v in {"n_videos": args.n_videos, "seed": args.seed, "width": args.size, "height": args.size,
                               "duration": args.duration, "hard_negative_rate": args.hard_negative_rate,
                               "near_duplicate_rate": args.near_duplicate_rate}.items() if v is not None}
    cfg = dataclasses.replace(base, **over)
    info = generate_corpus(args.out, cfg)
    print(json.dumps({k: v for k, v in info.items() if k != "videos"} if isinstance(info, dict) else info, indent=2, default=str)[:2000])
    return 0


def _validate_fit(cfg, args: argparse.Namespace) -> None:
    """Everything that can be checked without building the model: the model name, the files named on the
    command line and the training data itself (read, not decoded), so that a typo costs a second, not the
    model build."""

    if not cfg.data:
        raise ValueError("no training data: give --synth, --msrvtt-anno/--videos, --train-manifest or data: in --config")
    get_model_config(cfg.model)  # names the registered configs when unknown
    _require_file(args.resume, "--resume", "give a last.safetensors / best.safetensors written by an earlier fit")
    _require_file(cfg.init_checkpoint, "--init-checkpoint", "give a GARE checkpoint (.safetensors)")
    _check_data_paths(cfg.data)
    rs = load_dataset(cfg.data, "train")
    if not rs.clips:
        raise ValueError(f"the training data {cfg.data} has no clips; check the manifest's 'video' column and paths")
    missing = [c.path for c in rs.clips if not Path(c.path).is_file()]
    if len(missing) == len(rs.clips):
        raise FileNotFoundError(f"none of the {len(rs.clips)} video files in the training data exists (first: "
                                f"{missing[0]!r}); manifest video paths are relative to the manifest's folder")
    if missing:
        log.warning("%d of %d training video files do not exist (first: %s); they will be skipped",
                    len(missing), len(rs.clips), missing[0])
    train, _ = carve_validation(rs, cfg.val_fraction, cfg.seed)
    n = len(train.captions) if cfg.epoch == "captions" else len(train.clips)
    if n < cfg.batch_size:
        raise ValueError(f"{n} training examples ({cfg.epoch}, after holding out {cfg.val_fraction:g} for validation) "
                         f"is fewer than one batch of {cfg.batch_size}; give more data or a smaller --batch-size")


def _check_data_paths(data: dict) -> None:
    kind = data.get("kind")
    if kind == "synth":
        root = Path(data["root"])
        if not (root / "MSRVTT_data.json").is_file():
            raise FileNotFoundError(f"--synth {str(root)!r} is not a corpus written by `gare-train synth` "
                                    f"(no MSRVTT_data.json); run `gare-train synth {root}` first")
    elif kind == "manifest":
        for split in ("train", "test"):
            if data.get(split) is not None:
                _require_file(data[split], f"--{split}-manifest",
                              "give a CSV (video,caption[,start,end]) or JSONL caption file")
    elif kind == "msrvtt":
        for key, flag in (("anno_dir", "--msrvtt-anno"), ("videos_dir", "--videos")):
            if not data.get(key) or not Path(data[key]).is_dir():
                raise FileNotFoundError(f"{flag} {data.get(key)!r} is not a folder; give the MSR-VTT "
                                        f"{'annotation' if key == 'anno_dir' else 'videos'} folder")


def _cmd_fit(args: argparse.Namespace) -> int:
    over = {"model": args.model, "out_dir": args.out, "epochs": args.epochs, "max_steps": args.max_steps,
            "batch_size": args.batch_size, "lr": args.lr, "precision": args.precision, "device": args.device,
            "num_workers": args.num_workers, "seed": args.seed, "save_every": args.save_every,
            "ncl_train": True if args.ncl_train else None, "ncl_train_mode": args.ncl_train_mode, "queue_size": args.queue_size,
            "init_checkpoint": args.init_checkpoint, "preset": args.preset,
            "early_stop_patience": args.early_stop_patience, "cache_frames": True if args.cache_frames else None,
            "optimizer": args.optimizer}
    data = data_spec(args)
    if data:
        over["data"] = data
    if args.pretrained is not None:
        over["model_overrides"] = {"pretrained": args.pretrained}
    cfg = TrainConfig.from_sources(args.config, over)
    _validate_fit(cfg, args)
    summary = Trainer(cfg, resume=args.resume, progress=not args.no_progress).fit()
    print(json.dumps({k: v for k, v in summary.items() if k != "skipped"} | {"skipped": len(summary["skipped"])}, indent=2))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    data = data_spec(args)
    if not data:
        raise ValueError("no evaluation data: give --synth, --msrvtt-anno/--videos or --test-manifest")
    _require_file(args.checkpoint, "checkpoint", "give a .safetensors written by `gare-train fit`")
    _check_data_paths(data)
    rs = load_dataset(data, args.split)  # before the model: a bad data argument fails in a second
    model, ckpt = load_model(args.checkpoint, resolve_device(args.device))
    enc = encode_set(model, rs, batch_size=args.batch_size, num_workers=args.num_workers, precision=args.precision,
                     progress=True)
    queue = ckpt.queues.get("text")
    result = evaluate_encoded(model, enc, queue if args.ncl else None,
                              video_queue=ckpt.queues.get("video") if args.ncl else None)
    result["checkpoint"] = str(args.checkpoint)
    result["dataset"] = rs.name
    paths = write_report(result, args.out, title=f"GARE evaluation: {rs.name}")
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _register_train_commands(sub) -> None:
    sy = sub.add_parser("synth", help="generate a benchmark corpus of real mp4 files with captions")
    sy.add_argument("out")
    sy.add_argument("--preset", choices=["tiny", "small", "bench"], default=None)
    sy.add_argument("--n-videos", type=int)
    sy.add_argument("--seed", type=int)
    sy.add_argument("--size", type=int, help="frame width and height (even)")
    sy.add_argument("--duration", type=float)
    sy.add_argument("--hard-negative-rate", type=float)
    sy.add_argument("--near-duplicate-rate", type=float)
    sy.set_defaults(fn=_cmd_synth)

    fit = sub.add_parser("fit", help="train GARE (SPEC §3); torchrun for several GPUs/processes")
    fit.add_argument("--config", help="YAML with TrainConfig fields; flags override it")
    fit.add_argument("--preset", choices=["reference", "scratch"],
                     help="reference (default: the authors' recipe, needs CLIP weights) | scratch (random init)")
    fit.add_argument("--model", help="registered model config (gare-vit-b-32, gare-cpu-small, gare-cpu-demo, gare-test-tiny)")
    fit.add_argument("--pretrained", help="openai | a local CLIP weights file | none")
    fit.add_argument("--init-checkpoint", help="start from a GARE checkpoint's weights")
    fit.add_argument("--out", help="output folder (checkpoints, config.yaml, history)")
    add_data_args(fit)
    fit.add_argument("--epochs", type=int)
    fit.add_argument("--max-steps", type=int)
    fit.add_argument("--batch-size", type=int)
    fit.add_argument("--lr", type=float)
    fit.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    fit.add_argument("--device")
    fit.add_argument("--num-workers", type=int)
    fit.add_argument("--seed", type=int)
    fit.add_argument("--save-every", type=int)
    fit.add_argument("--queue-size", type=int)
    fit.add_argument("--ncl-train", action="store_true", help="train with Sinkhorn-adjusted logits")
    fit.add_argument("--ncl-train-mode", choices=("batch", "queue"), default=None,
                     help="with --ncl-train: the biases of the current batch's scores, text and video (batch: the NCL "
                          "paper, default) or video biases from the text queue's cosines (queue: the earlier form)")
    fit.add_argument("--optimizer", choices=["adamw", "bertadam"],
                     help="adamw (default) | bertadam: the authors' optimizer and warm-up cosine (exact reproduction)")
    fit.add_argument("--early-stop-patience", type=int, metavar="N",
                     help="stop when the validation R@1 has not improved for N epochs (default 0: never)")
    fit.add_argument("--cache-frames", action="store_true",
                     help="decode every clip once and keep the frames in memory (small corpora; no augmentation)")
    fit.add_argument("--resume", help="a last.safetensors / best.safetensors of the same configuration")
    fit.add_argument("--no-progress", action="store_true")
    fit.set_defaults(fn=_cmd_fit)

    ev = sub.add_parser("eval", help="R@k tables (dual, +psi, +NCL, both), deviation and coverage figures")
    ev.add_argument("checkpoint")
    add_data_args(ev)
    ev.add_argument("--split", default="test", choices=["train", "test"])
    ev.add_argument("--out", default="eval")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ev.add_argument("--batch-size", type=int, default=32)
    ev.add_argument("--num-workers", type=int, default=2)
    ev.add_argument("--no-ncl", dest="ncl", action="store_false", help="skip the NCL rows")
    ev.set_defaults(fn=_cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gare-train", description="Train, evaluate and convert GARE models.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging, third-party libraries' lines included")
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
    info.add_argument("--json", action="store_true", help="machine-readable output (everything in the header)")
    info.set_defaults(fn=_cmd_info)

    _register_train_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_cli_logging(args.verbose)
    try:
        return int(args.fn(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) adds quotes
        print(f"gare-train {args.cmd}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
