"""The applications built on the layerpar library: everything a user runs.

The library core (`layerpar.mgrit`, `layerpar.ode`, `layerpar.parallel`,
`layerpar._native`) never imports this package (tests/test_layering.py checks it).

- `cli`: the ``layerpar`` command (``train``, ``scale``, ``info``); `train`: data,
  options and the summary line of ``layerpar train`` and the examples; `loop`: the one
  training step and loop; `nets`: every network the front doors build; `data`: the
  bundled data sets; `launch`: starting and stopping MPI/torchrun jobs.
- `bench`: ``python -m layerpar.bench [sub]``, one command whose subcommands are the
  benchmarks `opcount` (ops), `gpubench` (gpu), `gridbench` (grid), `pathbench` (paths),
  `syncbench` (sync), `tta` (time to accuracy) and engines; `benchkit`: what the
  benchmark modules share (options, CSV, nets, timing), so none imports `bench` back.
- `studies`: the scaling and accuracy studies (``layerpar scale``,
  ``python -m layerpar.studies``).
"""
