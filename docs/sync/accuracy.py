"""Validation accuracy of the replica sync strategies (issue 18), Peaks and digits.

    .venv/bin/python docs/sync/accuracy.py [--epochs-peaks E] [--epochs-digits E]
                                           [--seeds 0,1,2]

Each run: ``layerpar train MODEL --np 4 --data-parallel 2 --nodes 2 --sync S
--optimizer O --seed s --epochs E`` (2 replicas x 2 layer ranks, the replicas in 2
simulated nodes; float32; MGRIT 3 levels, cf 4, 2/1 iterations).  Pairs compared:
DASO vs all-reduce (both Adam), Lion Cub vs all-reduce Lion.  Writes accuracy.csv and
accuracy.txt beside this script.  MNIST-1D is not bundled (no download at run time),
so digits stands in for it.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time
from pathlib import Path

from layerpar.apps.train import parse_summary

HERE = Path(__file__).parent
CONFIGS = [("allreduce", "adam"), ("daso", "adam"), ("allreduce", "lion"),
           ("lioncub", "lion")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs-peaks", type=int, default=8)
    p.add_argument("--epochs-digits", type=int, default=4)
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for model, epochs in (("peaks", args.epochs_peaks), ("digits", args.epochs_digits)):
        for seed in seeds:
            for sync, opt in CONFIGS:
                cmd = [sys.executable, "-m", "layerpar.cli", "train", model, "--np", "4",
                       "--data-parallel", "2", "--nodes", "2", "--sync", sync,
                       "--optimizer", opt, "--seed", str(seed), "--epochs", str(epochs),
                       "--no-progress"]
                t0 = time.time()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}"
                                       f"{proc.stderr[-2000:]}")
                s = parse_summary(proc.stdout)
                rows.append({"model": model, "epochs": epochs, "seed": seed, "sync": sync,
                             "optimizer": opt, "val_acc": s["val_acc"],
                             "train_loss": s["train_loss"], "ms_per_batch": s["ms_per_batch"],
                             "sync_bytes": s["sync_bytes"],
                             "seconds": round(time.time() - t0, 1)})
                print(rows[-1], flush=True)
                write(rows)  # after every run: a cut-short study keeps what it has
    print(write(rows))
    return 0


def write(rows: list[dict]) -> str:
    """accuracy.csv (every run) and accuracy.txt (the table of the configurations
    whose runs are all done); returns the table."""
    with open(HERE / "accuracy.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| problem (epochs) | sync | optimizer | val_acc per seed | mean | vs baseline "
             "(points) | sync_bytes/batch |", "|---|---|---|---|---|---|---|"]
    for model in ("peaks", "digits"):
        mean = {}
        for sync, opt in CONFIGS:
            rs = [r for r in rows if r["model"] == model and r["sync"] == sync
                  and r["optimizer"] == opt]
            if not rs or ("allreduce", opt) not in mean and sync != "allreduce":
                continue
            mean[(sync, opt)] = statistics.mean(r["val_acc"] for r in rs)
            base = mean[("allreduce", opt)]
            lines.append(f"| {model} ({rs[0]['epochs']}) | {sync} | {opt} | "
                         f"{', '.join(format(r['val_acc'], '.3f') for r in rs)} | "
                         f"{mean[(sync, opt)]:.3f} | "
                         f"{100 * (mean[(sync, opt)] - base):+.1f} | "
                         f"{statistics.mean(r['sync_bytes'] for r in rs):.0f} |")
    text = "\n".join(lines)
    (HERE / "accuracy.txt").write_text(text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
