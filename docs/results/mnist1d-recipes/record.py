"""Train one MNIST-1D recipe as ``layerpar train`` does and record every epoch.

    OMP_NUM_THREADS=1 python docs/results/mnist1d-recipes/record.py OUT.json \
        mnist1d --model resnet --serial

The arguments after OUT.json are those of ``layerpar train`` (parsed and checked by
its own parser); the run is `layerpar.apps.train.train_from_arguments`, the function
behind the command.  ``--num-samples N`` first (before OUT.json) trains on MNIST-1D
generated with N samples in all instead of ``layerpar train``'s 20,000 (80 % train):
5000 is the published benchmark's size (4000 train, 1000 test).  Writes the
per-epoch history (validation accuracy, training seconds), the wall time and the
machine to OUT.json and prints one line per epoch.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch

from layerpar.apps import cli
from layerpar.apps.train import train_from_arguments


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv: list[str]) -> int:
    num_samples = None
    if argv[:1] == ["--num-samples"]:
        num_samples, argv = int(argv[1]), argv[2:]
        from layerpar.apps import data, train

        def load_data(model_name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
            return data.mnist1d(num_samples=num_samples, seed=seed, dtype=dtype)

        train.load_data = load_data  # what `train` calls for its data
    out, rest = argv[0], argv[1:]
    args = cli.parse_args(["train", *rest, "--no-progress"])
    load = os.getloadavg()
    t0 = time.perf_counter()
    res = train_from_arguments(args.model, args)
    wall = time.perf_counter() - t0
    keys = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "train_seconds")
    history = [{k: r[k] for k in keys} for r in res.history]
    for r in history:
        print(f"epoch {r['epoch']:2d}  val_acc {r['val_acc']:.4f}  train_acc "
              f"{r['train_acc']:.4f}  train_seconds {r['train_seconds']:.0f}", flush=True)
    record = {"command": "layerpar train " + " ".join(rest),
              "num_samples": num_samples or 20000, "history": history,
              "best_val_acc": max(r["val_acc"] for r in history),
              "final_val_acc": history[-1]["val_acc"], "wall_seconds": wall,
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": f"{_cpu()}, {os.cpu_count()} cores, load average (1 min) "
                         f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: v for k, v in record.items() if k != "history"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
