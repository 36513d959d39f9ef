"""Nested iteration on digits: fine-level epochs to reach the from-scratch accuracy.

    python docs/results/nested/nested_digits.py        # writes docs/results/nested/nested-digits.csv

The fine net: the digits conv ODE-net with 16 residual layers, trained serially
(nested iteration is about the initialisation, not the solver) for 8 epochs from
scratch, and with nested iteration: 4 layers for 2 epochs, refined to 8 for 2
epochs, refined to 16 (`layerpar train digits --serial --nested 2 --nested-epochs 2`
with 16 layers), then 8 epochs.  Target: the from-scratch run's final validation
accuracy, minus 0.5 points.  Seeds 0-4.
"""
import csv
import sys
from pathlib import Path

from layerpar.apps.train import train

OUT = Path(__file__).with_name("nested-digits.csv")


def first(hist, target):
    """The 1-based epoch whose validation accuracy first reaches `target` (or None)."""
    return next((k + 1 for k, r in enumerate(hist) if r["val_acc"] >= target), None)


rows = []
for seed in (0, 1, 2, 3, 4):
    scratch = train("digits", serial=True, n_layers=16, seed=seed, progress=False)
    nested = train("digits", serial=True, n_layers=16, seed=seed, nested=2,
                   nested_epochs=2, progress=False)
    target = scratch.val_acc - 0.005
    fine = [r for r in nested.history if r["layers"] == 16]

    rows.append({"seed": seed, "target": round(target, 4),
                 "scratch_epochs_to_target": first(scratch.history, target),
                 "nested_fine_epochs_to_target": first(fine, target),
                 "scratch_final": scratch.val_acc, "nested_final": nested.val_acc,
                 "scratch_first_epoch_acc": scratch.history[0]["val_acc"],
                 "nested_first_fine_epoch_acc": fine[0]["val_acc"],
                 "scratch_seconds": round(scratch.seconds, 1),
                 "nested_seconds": round(nested.seconds, 1)})
    print(rows[-1], flush=True)
with OUT.open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
sys.exit(0)
