#!/bin/sh
# Peaks, 20 epochs, seeds 0-4: serial, adaptive accuracy on 4 ranks, exact propagation
# (max_levels=1) on the same 4 ranks.  Writes docs/results/adaptive/peaks-adaptive.txt.
set -e
cd "$(dirname "$0")/../../.."
out=docs/results/adaptive/peaks-adaptive.txt
: > "$out"
for s in 0 1 2 3 4; do
  for mode in "--serial" "--np 4" "--np 4 --adaptive" "--np 4 --levels 1"; do
    start=$(date +%s.%N)
    line=$(.venv/bin/layerpar train peaks --seed $s $mode --no-progress 2>&1 | tr '\n' '~')
    end=$(date +%s.%N)
    echo "seed $s | $mode | wall $(echo "$end - $start" | bc) s | $line" >> "$out"
  done
done
