"""Scaling studies of layer-parallel training: runs, serial baseline, model, plots.

`run_study` (`runner`) runs a grid of layer-parallel trainings under mpiexec
(`worker`; what a run is and builds: `runs`) and writes a CSV;
`layerpar.apps.studies.perfmodel`, the performance model, predicts time per batch from
measured step and message costs (`predict`, `count_steps`);
`layerpar.apps.studies.plots` draws the results.
The command line is ``layerpar scale`` or ``python -m layerpar.studies``.
"""
from .perfmodel import Costs, Prediction, count_steps, pipeline_seconds, predict
from .runner import REQUIRED_COLUMNS, StudyResult, run_study

__all__ = ["Costs", "Prediction", "REQUIRED_COLUMNS", "StudyResult", "count_steps",
           "pipeline_seconds", "predict", "run_study"]
