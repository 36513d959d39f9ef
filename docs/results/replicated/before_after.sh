#!/bin/bash
# Before (replicated.py of af80ed0) and after (this tree), alternated twice, at 2 ranks;
# then `layerpar.bench tta` case (c) with each.  Run from the repository root:
#   bash docs/results/replicated/before_after.sh [tta]     (alone on the machine)
# It swaps layerpar/parallel/replicated.py and puts it back (git checkout), so it
# refuses to run while that file has changes that are not committed.
set -e
if ! git diff --quiet HEAD -- layerpar/parallel/replicated.py; then
  echo "before_after.sh: layerpar/parallel/replicated.py has uncommitted changes;" \
       "commit or stash them first (this script swaps the file)" >&2
  exit 2
fi
trap 'git checkout -q layerpar/parallel/replicated.py' EXIT
run() { .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py docs/results/replicated/split_passes.py digits,peaks,prenorm 5; }
for i in 1 2; do
  git show af80ed0:layerpar/parallel/replicated.py > layerpar/parallel/replicated.py
  echo "before:"; run
  git checkout -q layerpar/parallel/replicated.py
  echo "after:"; run
done
if [ "$1" = tta ]; then
  git show af80ed0:layerpar/parallel/replicated.py > layerpar/parallel/replicated.py
  echo "before:"; .venv/bin/python -m layerpar.bench tta --np 2 --cases c --bounds default --out /tmp/tta_before | grep -E "target|batch split\)  "
  git checkout -q layerpar/parallel/replicated.py
  echo "after:"; .venv/bin/python -m layerpar.bench tta --np 2 --cases c --bounds default --out /tmp/tta_after | grep -E "target|batch split\)  "
fi
