"""Validation accuracy of the replica sync strategies (issue 18), Peaks and MNIST-1D.

    .venv/bin/python docs/results/sync/accuracy.py [--seeds 0,1,2] [--models peaks,mnist1d]
        [--epochs-peaks 20] [--epochs-mnist1d 10] [--layers-mnist1d 16]
        [--configs daso:adam,...] [--lr-scale 1] [--wrap /work/tools/heavy]

Each run: ``mpiexec -n 2`` of `layerpar.apps.train.train(MODEL, data_parallel=2, nodes=2,
sync=S, optimizer=O, seed=s, epochs=E)``: 2 replicas of one process each, in 2
simulated nodes, so every replica exchange is inter-node; MGRIT with one level (exact
propagation: the accuracy differences are the strategies', not MGRIT's); float32; the
recipes' batch size, lr (Lion: a third of Adam's) and cosine schedule.  Pairs
compared: DASO vs all-reduce (both Adam), Lion Cub vs all-reduce Lion.  Writes
accuracy.csv (every run, with its per-epoch validation accuracy: the curve) and
accuracy.txt (the table) beside this script, after every run.  `--wrap` prefixes each
job's command (on the shared machine: /work/tools/heavy, one lock per run).
`--configs` runs some of the sync:optimizer pairs only (e.g. a changed DASO against
baselines measured before: `--merge` them in, later outputs replacing earlier runs of
the same model, sync, optimizer and seed).  `--lr-scale` multiplies the learning rate
(a diagnostic: how sensitive a problem is to a smaller step).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
CONFIGS = [("allreduce", "adam"), ("daso", "adam"), ("allreduce", "lion"),
           ("lioncub", "lion")]
MARK = "SYNCACC "


def worker(model: str, sync: str, opt: str, seed: int, epochs: int, layers: int,
           lr_scale: float = 1.0) -> None:
    import torch
    from mpi4py import MPI

    from layerpar.apps.train import RECIPES, train
    from layerpar.mgrit import MGRITOptions

    torch.set_num_threads(1)
    exact = MGRITOptions(max_levels=1)
    lr = None if lr_scale == 1.0 else (
        RECIPES[model].lr / (3 if opt == "lion" else 1) * lr_scale)
    r = train(model, comm=MPI.COMM_WORLD, data_parallel=2, nodes=2, sync=sync,
              optimizer=opt, seed=seed, epochs=epochs, n_layers=layers or None,
              lr=lr, fwd=exact, bwd=exact, progress=False)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(MARK + json.dumps({
            "val_acc": r.val_acc, "train_loss": r.train_loss,
            "ms_per_batch": r.ms_per_batch, "sync_bytes": r.sync_bytes,
            "curve": [round(h["val_acc"], 4) for h in r.history]}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs-peaks", type=int, default=20)
    p.add_argument("--epochs-mnist1d", type=int, default=10)
    p.add_argument("--layers-mnist1d", type=int, default=16)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--models", default="peaks,mnist1d")
    p.add_argument("--configs", default=",".join(f"{s}:{o}" for s, o in CONFIGS),
                   metavar="SYNC:OPT,...", help="the pairs to run (default: all)")
    p.add_argument("--lr-scale", type=float, default=1.0,
                   help="the recipes' learning rates times this (default 1)")
    p.add_argument("--wrap", default="", help="command prefix for each job")
    p.add_argument("--out", default="accuracy", help="output name (.csv, .txt)")
    p.add_argument("--merge", default="", metavar="A,B",
                   help="only merge these outputs (names) into --out's table")
    p.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.merge:
        runs: dict[tuple, dict] = {}  # a later output's run replaces an earlier one's
        for name in args.merge.split(","):
            with open(HERE / f"{name}.csv", newline="") as fh:
                for r in csv.DictReader(fh):
                    r = {k: (float(v) if k == "val_acc" else int(v) if k == "seed" else v)
                         for k, v in r.items()}
                    runs[(r["model"], r["sync"], r["optimizer"], r["seed"])] = r
        rows = sorted(runs.values(), key=lambda r: (
            r["seed"], r["model"] != "peaks",
            CONFIGS.index((r["sync"], r["optimizer"]))))
        print(write(rows, args.out))
        return 0
    if args.worker:
        m, s, o, seed, e, lay, scale = args.worker
        worker(m, s, o, int(seed), int(e), int(lay), float(scale))
        return 0
    from layerpar.apps.launch import mpiexec_path

    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    if not all(c in CONFIGS for c in configs):
        p.error(f"--configs: each must be one of "
                f"{', '.join(f'{s}:{o}' for s, o in CONFIGS)}, got {args.configs!r}")
    seeds = [int(s) for s in args.seeds.split(",")]
    epochs = {"peaks": args.epochs_peaks, "mnist1d": args.epochs_mnist1d}
    layers = {"peaks": 0, "mnist1d": args.layers_mnist1d}
    rows: list[dict] = []
    for seed in seeds:
        for model in args.models.split(","):
            for sync, opt in configs:
                cmd = [*args.wrap.split(), str(mpiexec_path()), "-n", "2", sys.executable,
                       str(Path(__file__).resolve()), "--worker", model, sync, opt,
                       str(seed), str(epochs[model]), str(layers[model]),
                       repr(args.lr_scale)]
                t0 = time.time()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                      env={**__import__("os").environ,
                                           "OMP_NUM_THREADS": "1"})
                got = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
                if proc.returncode != 0 or not got:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}"
                                       f"{proc.stderr[-2000:]}")
                r = json.loads(got[0][len(MARK):])
                rows.append({"model": model, "layers": layers[model] or "recipe",
                             "epochs": epochs[model], "seed": seed, "sync": sync,
                             "optimizer": opt, "val_acc": r["val_acc"],
                             "train_loss": round(r["train_loss"], 4),
                             "ms_per_batch": round(r["ms_per_batch"], 1),
                             "sync_bytes": round(r["sync_bytes"]),
                             "seconds": round(time.time() - t0, 1),
                             "curve": " ".join(f"{a:.3f}" for a in r["curve"])})
                print(rows[-1], flush=True)
                write(rows, args.out)  # after every run: a cut-short study keeps what it has
    print(write(rows, args.out))
    return 0


def write(rows: list[dict], name: str) -> str:
    """<name>.csv (every run) and <name>.txt (the table: per configuration the
    accuracy per seed, the mean, the difference from its baseline with the spread of
    the paired per-seed differences); returns the table."""
    with open(HERE / f"{name}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| problem (epochs) | sync | optimizer | val_acc per seed | mean | vs baseline "
             "(points; paired per seed: mean ± sd) | sync_bytes/batch |",
             "|---|---|---|---|---|---|---|"]
    for model in ("peaks", "mnist1d"):
        for sync, opt in CONFIGS:
            rs = {r["seed"]: r for r in rows if r["model"] == model and r["sync"] == sync
                  and r["optimizer"] == opt}
            base = {r["seed"]: r for r in rows if r["model"] == model
                    and r["sync"] == "allreduce" and r["optimizer"] == opt}
            if not rs:
                continue
            mean = statistics.mean(r["val_acc"] for r in rs.values())
            diffs = [100 * (rs[s]["val_acc"] - base[s]["val_acc"]) for s in rs if s in base]
            vs = "baseline" if sync == "allreduce" else (
                f"{statistics.mean(diffs):+.1f} ± "
                f"{statistics.stdev(diffs) if len(diffs) > 1 else 0:.1f}" if diffs else "-")
            r0 = next(iter(rs.values()))
            lines.append(f"| {model} ({r0['epochs']}) | {sync} | {opt} | "
                         f"{', '.join(format(r['val_acc'], '.3f') for r in rs.values())} | "
                         f"{mean:.3f} | {vs} | "
                         f"{statistics.mean(float(r['sync_bytes']) for r in rs.values()):.0f} |")
    text = "\n".join(lines)
    (HERE / f"{name}.txt").write_text(text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
