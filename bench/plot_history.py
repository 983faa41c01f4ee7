"""Plot a training run's loss terms against the step (from the run's history.json) to a PNG.

    python -m bench.plot_history RUN_DIR OUT.png

RUN_DIR is a `gare-train fit` output folder (history.json: one row per optimizer step with the four loss
terms, the total, the gradient norm and the logit scale).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(run: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads((run / "history.json").read_text())
    if not rows:
        raise SystemExit(f"{run}/history.json has no steps")
    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, label in (("total", "total"), ("info", "L_info")):
        a.plot(steps, [r[key] for r in rows], label=label)
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(steps, [r["dir"] for r in rows], label="L_dir")
    b.plot(steps, [r["eps"] for r in rows], label="L_eps")
    b.set_xlabel("step")
    b.legend()
    b.grid(alpha=0.3)
    fig.suptitle(f"{run.name}: {len(rows)} steps")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    plot(args.run, args.out)


if __name__ == "__main__":
    main()
