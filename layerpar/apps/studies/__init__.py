"""Scaling studies of layer-parallel training: runs, serial baseline, model, plots.

`run_study` (`runner`) runs a grid of layer-parallel trainings under mpiexec
(`worker`; what a run is and builds: `runs`) and writes a CSV;
`layerpar.apps.studies.perfmodel`, the performance model, predicts time per batch from
measured step and message costs (`predict`, `count_steps`);
`layerpar.apps.studies.plots` draws the results.
The command line is ``layerpar scale`` or ``python -m layerpar.studies``.

The names below are imported lazily, so that the command line (`cli`) builds its
parser, and prints its help, without loading torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Costs", "Prediction", "REQUIRED_COLUMNS", "StudyResult", "count_steps",
           "pipeline_seconds", "predict", "run_study"]

_WHERE = {**{name: "perfmodel" for name in ("Costs", "Prediction", "count_steps",
                                             "pipeline_seconds", "predict")},
          **{name: "runner" for name in ("REQUIRED_COLUMNS", "StudyResult", "run_study")}}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
