"""`gare-train fit`: the training loop (SPEC §3). Imported only by the CLI, never by the light modules.

Distributed: launched with torchrun, every rank decodes and encodes its share of the batch, the features are
all-gathered (gradients flow back to the local share, as in the reference) so each rank scores the global
batch, and gradients are averaged across ranks before clipping. gloo on CPU, nccl on GPU.

Resume is exact: the data order, caption choice and augmentation are pure functions of (seed, epoch,
example), and the model, optimizer, scheduler, RNG states, NCL queues and the position in the epoch are
saved together.

An epoch visits every training caption once (the authors' loaders), so steps per epoch, the warm-up and
the cosine schedule follow from the number of captions, not clips.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from gare.annotations import carve_validation, load_dataset
from gare.checkpoint import CheckpointError, load_tree, read_checkpoint, save_checkpoint, save_tree
from gare.config import LossConfig, get_model_config
from gare.encoded_set import encode_set
from gare.model import GARE, autocast, resolve_device
from gare.video_loader import collate_clips
from gare_train.data import PairDataset, collate_pairs, decode_to_memory, epoch_order
from gare_train.evaluate import evaluate_encoded
from gare_train.loss import gare_loss
from gare_train.ncl_logits import batch_adjusted, queue_adjusted
from gare_train.optim import build_optimizer, build_scheduler
from gare_train.ranks import average_gradients, gather
from gare_train.train_config import TrainConfig

log = logging.getLogger(__name__)


def freeze_patch_embedding(model: GARE) -> list[str]:
    """Freeze the backbone's patch-embedding conv (the authors' default); returns the frozen names."""
    visual = getattr(model.clip, "visual", None)
    conv = getattr(visual, "conv1", None)
    if conv is None:
        log.warning("%s has no visual.conv1 patch embedding; nothing frozen", model.cfg.backbone)
        return []
    for p in conv.parameters():
        p.requires_grad_(False)
    return [f"clip.visual.conv1.{n}" for n, _ in conv.named_parameters()]


class FeatureQueue:
    """FIFO of the most recent `size` embeddings (NCL's stand-in for the unknown test queries)."""

    def __init__(self, size: int, dim: int) -> None:
        self.size, self.buf, self.n, self.ptr = size, torch.zeros(size, dim), 0, 0

    def push(self, x: torch.Tensor) -> None:
        x = x.detach().float().cpu()[-self.size:]
        idx = (self.ptr + torch.arange(len(x))) % self.size
        self.buf[idx] = x
        self.ptr = int((self.ptr + len(x)) % self.size)
        self.n = min(self.size, self.n + len(x))

    def tensor(self) -> torch.Tensor:
        """Oldest first."""
        if self.n < self.size:
            return self.buf[: self.n].clone()
        return torch.cat([self.buf[self.ptr:], self.buf[: self.ptr]])

    def state(self) -> dict[str, Any]:
        return {"buf": self.buf, "n": self.n, "ptr": self.ptr}

    def load(self, st: dict[str, Any]) -> None:
        self.buf, self.n, self.ptr = st["buf"].clone(), int(st["n"]), int(st["ptr"])


def _rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state(), "python": json.dumps(random.getstate()),
          "numpy": json.dumps(np.random.get_state()[1].tolist()), "numpy_pos": int(np.random.get_state()[2])}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    py = json.loads(st["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(("MT19937", np.array(json.loads(st["numpy"]), dtype=np.uint32), st["numpy_pos"], 0, 0.0))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(st["cuda"]))


# ---------------------------------------------------------------- the loop
class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: str | None = None, progress: bool = True) -> None:
        self.cfg = cfg
        self.progress = progress
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.distributed and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo"
            dist.init_process_group(backend)
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size={cfg.batch_size} is not divisible by the world size {self.world}")
        if self.distributed and torch.cuda.is_available() and cfg.device != "cpu":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = resolve_device(cfg.device)
        self.out = Path(cfg.out_dir)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)

        model_cfg = get_model_config(cfg.model, **cfg.model_overrides)
        if cfg.init_checkpoint:
            ck = read_checkpoint(cfg.init_checkpoint)
            model_cfg = ck.config
            self.model = GARE.build(model_cfg, pretrained="none")
            self.model.load_state_dict(ck.state_dict)
        else:
            self.model = GARE.build(model_cfg)
            if model_cfg.pretrained.lower() in ("", "none") and cfg.coef_lr < 1.0:
                log.warning(
                    "training %s from random initialisation with the reference settings (lr %g, CLIP at lr x %g): "
                    "they assume pretrained CLIP weights and barely move a random backbone; "
                    "use --preset scratch (or give --pretrained)", cfg.model, cfg.lr, cfg.coef_lr,
                )
        if cfg.freeze_patch_embed:
            freeze_patch_embedding(self.model)
        self.model.to(self.device)
        self.loss_cfg = LossConfig(**cfg.loss)

        full = load_dataset(cfg.data, "train")
        self.train_set, self.val_set = carve_validation(full, cfg.val_fraction, cfg.seed)
        self.pairs = PairDataset(self.train_set, max_frames=model_cfg.max_frames,
                                 framerate=model_cfg.video_framerate, image_size=model_cfg.image_size, seed=cfg.seed,
                                 epoch=cfg.epoch, augment=cfg.augment, augment_spec=cfg.augment_spec)
        self.steps_per_epoch = len(self.pairs) // cfg.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.pairs)} training examples ({cfg.epoch}) is fewer than one batch of {cfg.batch_size}")
        log.info("epoch: %d examples (one per %s) from %d clips, %d steps of %d", len(self.pairs), cfg.epoch[:-1],
                 len(self.train_set.clips), self.steps_per_epoch, cfg.batch_size)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        d = model_cfg.embed_dim
        self.text_queue, self.video_queue = FeatureQueue(cfg.queue_size, d), FeatureQueue(cfg.queue_size, d)
        self.step, self.best_val, self.skipped = 0, -1.0, []
        self.bad_epochs = 0  # epochs in a row without a better validation R@1 (early_stop_patience)
        self.stopped_early: int | None = None  # the epoch after which early stopping ended the run
        self.val_decoded: list[dict[str, Any]] | None = None  # validation clips decoded once (cache_frames)
        self.history: list[dict[str, Any]] = []
        if resume:
            self._resume(resume)

    # -------------------------------------------------------------- state
    def _paths(self, name: str) -> tuple[Path, Path]:
        return self.out / f"{name}.safetensors", self.out / f"{name}.state.safetensors"

    def save(self, name: str) -> Path:
        if self.rank != 0:
            return self._paths(name)[0]
        model_path, state_path = self._paths(name)
        queues = {"text": self.text_queue.tensor(), "video": self.video_queue.tensor()}
        info = {"step": self.step, "epoch": self.step // self.steps_per_epoch, "best_val_r1": self.best_val}
        save_checkpoint(model_path, self.model, queues=queues, train_args=self.cfg.fingerprint(), info=info)
        save_tree(state_path, {
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(), "step": self.step, "best_val": self.best_val, "bad_epochs": self.bad_epochs,
            "text_queue": self.text_queue.state(), "video_queue": self.video_queue.state(),
            "config": json.dumps(self.cfg.fingerprint(), sort_keys=True), "history": json.dumps(self.history),
        })
        return model_path

    def _resume(self, path: str) -> None:
        model_path = Path(path)
        state_path = model_path.with_name(model_path.name.replace(".safetensors", ".state.safetensors"))
        if not state_path.exists():
            raise CheckpointError(f"{state_path} not found: cannot resume from {model_path} (only fine-tune with init_checkpoint)")
        state = load_tree(state_path)
        mine = json.dumps(self.cfg.fingerprint(), sort_keys=True)
        if state["config"] != mine:
            theirs = json.loads(state["config"])
            ours = self.cfg.fingerprint()  # either side may lack a field left out at its default (optimizer)
            diff = {k: (theirs.get(k), ours.get(k)) for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)}
            raise CheckpointError(f"refusing to resume: {model_path} comes from a different configuration: {diff}")
        ck = read_checkpoint(model_path)
        self.model.load_state_dict(ck.state_dict)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.text_queue.load(state["text_queue"])
        self.video_queue.load(state["video_queue"])
        self.step, self.best_val = int(state["step"]), float(state["best_val"])
        self.bad_epochs = int(state.get("bad_epochs", 0))  # absent in states written before early stopping
        self.history = json.loads(state["history"])
        _set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", model_path, self.step)

    # -------------------------------------------------------------- steps
    def _loader(self, epoch: int, skip_batches: int):
        self.pairs.epoch = epoch
        order = epoch_order(len(self.pairs), self.cfg.seed, epoch)[: self.steps_per_epoch * self.cfg.batch_size]
        local = self.cfg.batch_size // self.world
        # Global batch g holds order[g*B:(g+1)*B]; this rank takes its contiguous share of each.
        mine = []
        for g in range(skip_batches, self.steps_per_epoch):
            base = g * self.cfg.batch_size + self.rank * local
            mine.extend(order[base:base + local])
        return torch.utils.data.DataLoader(
            torch.utils.data.Subset(self.pairs, mine), batch_size=local, shuffle=False,
            # cached frames are already in this process: worker processes would only copy them through pipes
            num_workers=0 if self.pairs.cache is not None else self.cfg.num_workers, collate_fn=collate_pairs,
            persistent_workers=False, timeout=600 if self.cfg.num_workers and self.pairs.cache is None else 0,
            # its own generator: worker seeding must not consume the global RNG that dropout uses,
            # or a resumed run would draw different dropout masks than an uninterrupted one
            generator=torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch),
        )

    def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        model, dev = self.model, self.device
        model.train()
        with autocast(dev, self.cfg.precision):
            t = model.encode_text(model.tokenize(batch["captions"]))
            Fv, vbar = model.encode_video(batch["frames"], batch["mask"])
        mask = batch["mask"].to(dev)
        t, Fv, vbar, mask = gather(t.float()), gather(Fv.float()), gather(vbar.float()), gather(mask)
        s, delta = model.pair_logits(t, Fv, mask, vbar)
        if self.cfg.ncl_train:  # NCL §3.3: Sinkhorn-adjusted logits (gare_train.ncl_logits)
            gamma = float(1.0 / model.clip.logit_scale.exp())
            if self.cfg.ncl_train_mode == "batch":
                s = batch_adjusted(s, gamma, self.cfg.ncl_iters)
            elif self.text_queue.n > 0:
                s = queue_adjusted(s, self.text_queue.tensor(), t, vbar, gamma, self.cfg.ncl_iters)
        terms = gare_loss(s, delta, model.clip.logit_scale, self.loss_cfg)
        self.optimizer.zero_grad(set_to_none=True)
        terms["total"].backward()
        params = [p for p in model.parameters() if p.requires_grad]
        if self.distributed:
            average_gradients(params)
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        model.clamp_logit_scale()
        self.text_queue.push(t)
        self.video_queue.push(vbar)
        self.step += 1
        out = {k: float(v.detach()) for k, v in terms.items()}
        out["grad_norm"] = float(gnorm)
        out["logit_scale"] = float(model.clip.logit_scale.detach().exp())
        return out

    def validate(self) -> dict[str, Any]:
        enc = encode_set(self.model.eval(), self.val_set, batch_size=32, num_workers=self.cfg.num_workers,
                         decoded=self.val_decoded)
        return evaluate_encoded(self.model, enc, self.text_queue.tensor(), video_queue=self.video_queue.tensor())

    def _fill_frame_cache(self) -> None:
        """cache_frames: decode the training and validation clips once, before the first step."""
        show = self.progress and self.rank == 0
        self.pairs.fill_cache(num_workers=self.cfg.num_workers, progress=show)
        if len(self.val_set.clips):
            m = self.model.cfg
            items = [(i, c.path, c.start, c.end) for i, c in enumerate(self.val_set.clips)]
            cache = decode_to_memory(items, max_frames=m.max_frames, framerate=m.video_framerate,
                                     image_size=m.image_size, num_workers=self.cfg.num_workers,
                                     desc="decode validation clips" if show else None)
            keys = sorted(cache)
            self.val_decoded = [collate_clips([cache[k] for k in keys[i:i + 32]]) for i in range(0, len(keys), 32)]

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "config.yaml", "w") as fh:
                yaml.safe_dump(dataclasses.asdict(cfg), fh, sort_keys=True)
        bar = None
        stop_at = min(self.total_steps, cfg.max_steps) if cfg.max_steps else self.total_steps
        if cfg.cache_frames and self.step < stop_at:
            # decoding must not move the RNG that training draws dropout masks from (a DataLoader draws its
            # base seed from it), or caching would change the run
            with torch.random.fork_rng(devices=[]):
                self._fill_frame_cache()
        if self.progress and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=stop_at, initial=self.step, desc="fit", unit="step", dynamic_ncols=True)
        t_last, n_last = time.perf_counter(), 0
        while self.step < stop_at and not self._patience_spent():
            epoch, in_epoch = divmod(self.step, self.steps_per_epoch)
            for batch in self._loader(epoch, in_epoch):
                self.skipped += batch["failed"]
                n_ok = torch.tensor([len(batch["captions"])])
                if self.distributed:
                    dist.all_reduce(n_ok, op=dist.ReduceOp.MIN)
                if int(n_ok) < 2:
                    # a whole local batch failed to decode; every rank skips the step together
                    self.step += 1
                    self.scheduler.step()
                    continue
                if self.distributed and int(n_ok) != len(batch["captions"]):
                    # keep gathered shapes equal across ranks: trim to the smallest local batch
                    k = int(n_ok)
                    batch = {**batch, "frames": batch["frames"][:k], "mask": batch["mask"][:k], "captions": batch["captions"][:k]}
                terms = self.train_step(batch)
                n_last += len(batch["captions"]) * self.world
                if bar is not None:
                    now = time.perf_counter()
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{terms['total']:.3f}", info=f"{terms['info']:.3f}", ib=f"{terms['ib']:.1f}",
                        dir=f"{terms['dir']:.3f}", eps=f"{terms['eps']:.3f}",
                        lr=f"{max(self.scheduler.get_last_lr()):.2e}", clips_s=f"{n_last / max(now - t_last, 1e-9):.1f}",
                        **({"best_val_R1": f"{self.best_val:.1f}"} if self.best_val >= 0 else {}),
                    )
                    t_last, n_last = now, 0
                self.history.append({"step": self.step, **terms})
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save("last")
                if self.step >= stop_at or self.step % self.steps_per_epoch == 0:
                    break
            if self.step % self.steps_per_epoch == 0:
                self._end_of_epoch()
                if self._patience_spent():
                    self.stopped_early = self.step // self.steps_per_epoch
                    log.info("early stop after epoch %d: validation R@1 has not improved for %d epochs (best %.2f)",
                             self.stopped_early, self.bad_epochs, self.best_val)
            elif self.step >= stop_at:
                self.save("last")  # stopped mid-epoch (max_steps): a resumable checkpoint, no validation
        if bar is not None:
            bar.close()
        summary = {"steps": self.step, "best_val_r1": self.best_val, "skipped": self.skipped,
                   "epochs_run": self.step / self.steps_per_epoch, "stopped_early_after_epoch": self.stopped_early,
                   "first_loss": self.history[0]["total"] if self.history else None,
                   "last_loss": self.history[-1]["total"] if self.history else None}
        if self.rank == 0:
            (self.out / "history.json").write_text(json.dumps(self.history))
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
            if self.skipped:
                log.warning("%d clips could not be decoded and were skipped: %s", len(self.skipped), self.skipped[:5])
        if self.distributed:
            dist.barrier()
        return summary

    def _patience_spent(self) -> bool:
        p = self.cfg.early_stop_patience
        return bool(p) and self.bad_epochs >= p

    def _end_of_epoch(self) -> None:
        r1 = -1.0
        if self.rank == 0 and len(self.val_set.clips):
            # validation must not move the RNG that training draws dropout masks from
            with torch.random.fork_rng(devices=[]):
                res = self.validate()
            r1 = res["rows"]["+ psi"]["t2v"]["R1"]
            log.info("step %d: validation t2v R@1 %.2f (dual-tower %.2f)", self.step, r1, res["rows"]["dual-tower"]["t2v"]["R1"])
        if self.distributed:
            r = torch.tensor([r1])
            dist.broadcast(r, 0)
            r1 = float(r)
        improved = r1 > self.best_val
        if improved:
            self.best_val = r1
        self.bad_epochs = 0 if improved else self.bad_epochs + 1
        self.save("last")
        if improved:
            self.save("best")
